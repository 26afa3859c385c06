"""The Open Inference Protocol (KServe v2, Triton): `/v2` metadata and infer (protocol: tensors and binary data;
router; per-kind signatures; error shape)."""

"""The Open Inference Protocol over gRPC (`inference.GRPCInferenceService`, what `tritonclient.grpc` calls), beside
the REST routes in the same process and event loop: `server` (the grpc.aio server and `grpc.health.v1`),
`servicer` (the RPCs), `tensors` (messages <-> tensors), `calls` (auth, errors, metrics, logs, spans per call),
`wire` (what its clients share with it: parameters, the final-response flag), `protos` (`make proto`: the stubs
in `generated/` from the upstream protos in `proto/`)."""

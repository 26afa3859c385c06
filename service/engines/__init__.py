"""Model engines over ONNX Runtime: prefill/step for the text models, batched classification for the ViT."""

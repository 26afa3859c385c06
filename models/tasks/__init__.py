"""Per-model training tasks: data batches, loss, validation and final evaluation."""

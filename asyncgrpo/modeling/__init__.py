"""The trained model beyond a plain causal LM: model families (image-text checkpoints, MoE routers),
PEFT adapters, MoE routing replay, sharded tensors read whole, and the model FLOPs behind the MFU
metrics."""

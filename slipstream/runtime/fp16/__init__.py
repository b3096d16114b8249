"""``deepspeed.runtime.fp16``: DeepSpeed's loss scalers (``loss_scaler``) and the names of its
fp16 optimizer wrappers (``fused_optimizer.FP16_Optimizer``,
``unfused_optimizer.FP16_UnfusedOptimizer``), which slipstream refuses to build: its engine
keeps the fp32 master weights and the loss scale itself (``"fp16": {"enabled": true}``)."""

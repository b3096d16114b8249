"""``deepspeed.ops``: DeepSpeed's optimizer classes, on torch's kernels (nothing is compiled).

``__compatible_ops__`` answers, per DeepSpeed op name, whether slipstream runs that op
(``deepspeed.ops.op_builder``): code written for DeepSpeed checks it before using an op.
"""

from slipstream.ops import adam, op_builder

__compatible_ops__: dict[str, bool] = {
    name: builder().is_compatible() for name, builder in op_builder.ALL_OPS.items()
}

__all__ = ["__compatible_ops__", "adam", "op_builder"]

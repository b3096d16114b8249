"""Model parallelism: tensor parallel (``tensor``) and pipeline parallel (``pipeline``).

Both take their process groups from the one named DeviceMesh (``slipstream.distributed.mesh``)
and compose with ZeRO over the data-parallel axes.
"""

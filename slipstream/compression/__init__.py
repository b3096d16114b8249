"""DeepSpeed's compression library (``deepspeed.compression``) on slipstream's quantizers.

``helper`` holds the module-tree utilities that DeepSpeed-Chat and other scripts import
(``recursive_getattr``, ``recursive_setattr``).
"""

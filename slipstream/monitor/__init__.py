"""``deepspeed.monitor``: DeepSpeed's monitor classes over slipstream's monitor backends.

The modules keep DeepSpeed's paths and names (``monitor.MonitorMaster``,
``tensorboard.TensorBoardMonitor``, ``csv_monitor.csvMonitor``, ``wandb.WandbMonitor``,
``comet.CometMonitor``, ``config.get_monitor_config``); the writing is done by the backends of
:mod:`slipstream.profiling.monitor`, the ones the engine's ``monitor`` uses. These classes write
synchronously, as DeepSpeed's do: after ``write_events`` returns, the CSV rows are in their files
and the TensorBoard events are flushed. (The engine's own monitor batches its writes on a
thread; see docs/observability.md.)
"""

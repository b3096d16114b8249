"""One source for peak FLOP/s: the data-sheet table feeds the planner's built-in profiles and
the FLOPs profiler's MFU alike; a profile that names an accelerator cannot contradict it."""

from __future__ import annotations

import pytest
import torch

from slipstream.accelerator.peaks import data_sheet, data_sheet_peak
from slipstream.planner import BUILTIN_PROFILES, Hardware, load_hardware
from slipstream.profiling.flops import device_peak_flops


@pytest.mark.parametrize("name", BUILTIN_PROFILES)
def test_builtin_profiles_read_the_data_sheets(name: str) -> None:
    hw = load_hardware(name)
    sheet = next(s for s in ("A100", "H100", "MI250X") if s in name.upper())
    assert hw.peak_tflops * 1e12 == data_sheet_peak(sheet, torch.bfloat16)
    assert hw.sources["peak_tflops"] == data_sheet(sheet).source  # type: ignore[union-attr]
    # A written profile (peak_tflops and no accelerator) loads back to the same numbers.
    assert Hardware.from_dict(hw.to_dict()) == hw


def test_profiler_mfu_peak_is_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """The profiler looks the CUDA device's name up in the same table: one MI250X GCD (a
    torch device) peaks at the planner profile's 191.5 TFLOP/s, not the module's 383."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "AMD Instinct MI250X")
    peak = device_peak_flops(torch.device("cuda", 0), torch.bfloat16)
    assert peak == load_hardware("frontier-mi250x").peak_tflops * 1e12 == 191.5e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    assert device_peak_flops(torch.device("cuda", 0), torch.bfloat16) == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Some Future GPU")
    assert device_peak_flops(torch.device("cuda", 0), torch.bfloat16) is None


def test_a_profile_cannot_contradict_its_data_sheet() -> None:
    data = load_hardware("dgx-a100-80gb").to_dict()
    with pytest.raises(ValueError, match=r"peak_tflops = 300\.0 but the A100 data sheet says 312"):
        Hardware.from_dict({**data, "accelerator": "A100", "peak_tflops": 300.0})
    del data["peak_tflops"]
    with pytest.raises(ValueError, match="accelerator 'TPU' has no bf16 data sheet"):
        Hardware.from_dict({**data, "accelerator": "TPU"})
    assert Hardware.from_dict({**data, "accelerator": "A100"}).peak_tflops == 312.0


def test_planner_reads_zero_defaults_from_the_config_types() -> None:
    from slipstream.config.zero import ZeroConfig
    from slipstream.planner import memory

    defaults = ZeroConfig()
    assert defaults.reduce_bucket_size == memory._REDUCE_BUCKET
    assert defaults.stage3_prefetch_bucket_size == memory._PREFETCH_BUCKET

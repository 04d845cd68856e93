"""Hardware profiles: shipped set, provenance, loading by name and path."""

import json

import pytest

from planner.errors import SpecError, UnknownNameError
from planner.hardware import HardwareProfile, list_profiles, load_profile, save_profile
from planner.spec import DType

REQUIRED = {
    "a100-sxm-40gb", "a100-sxm-80gb", "h100-sxm-80gb", "h100-96gb", "h200-sxm-141gb", "b200",
    "mi300x",
}  # fmt: skip


def test_every_required_profile_ships_and_loads():
    assert set(list_profiles()) >= REQUIRED
    for name in REQUIRED:
        profile = load_profile(name)
        assert profile.name == name
        assert profile.peak_flops(DType.BF16) > 1e14


def test_every_number_has_a_source():
    for name in list_profiles():
        profile = load_profile(name)
        assert set(profile.numeric_fields()) <= set(profile.sources)
        assert all(profile.sources[field].strip() for field in profile.numeric_fields())


def test_profile_without_a_source_is_rejected():
    data = load_profile("a100-sxm-80gb").model_dump(mode="json")
    del data["sources"]["memory_bandwidth_GBps"]
    with pytest.raises(ValueError, match="memory_bandwidth_GBps"):
        HardwareProfile.model_validate(data)


def test_unknown_name_lists_profiles():
    with pytest.raises(UnknownNameError) as info:
        load_profile("a100-sxm-81gb")
    assert "a100-sxm-80gb" in str(info.value)
    assert "mi300x" in str(info.value)


def test_path_round_trip_and_cpu_profile(tmp_path):
    data = load_profile("a100-sxm-80gb").model_dump(mode="json")
    data.update(name="cpu-gloo", device_kind="cpu", peak_tflops={"fp32": 0.5})
    data["sources"] = {k: "measured 2026-11-30 on this machine" for k in data["sources"]}
    data["sources"]["peak_tflops.fp32"] = "measured 2026-11-30 matmul sweep"
    profile = HardwareProfile.model_validate(data)
    path = tmp_path / "cpu-gloo.json"
    save_profile(profile, path)
    assert load_profile(str(path)) == profile
    assert json.loads(path.read_text())["device_kind"] == "cpu"
    with pytest.raises(SpecError, match="bf16"):
        profile.peak_flops(DType.BF16)


def test_missing_profile_file_is_a_clear_error(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_profile(str(tmp_path / "nope.json"))

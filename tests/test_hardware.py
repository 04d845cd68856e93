"""Hardware profiles: shipped set, provenance, loading by name and path."""

import json

import pytest

from planner.errors import SpecError, UnknownNameError
from planner.hardware import HardwareProfile, list_profiles, load_profile, save_profile
from planner.spec import DType

REQUIRED = {
    "a100-sxm-40gb", "a100-sxm-80gb", "h100-sxm-80gb", "h100-96gb", "h200-sxm-141gb", "b200",
    "gb200", "mi300x",
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


def test_a_profile_file_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_bytes(b"\xff\xd8\xff\xe0 JFIF")
    with pytest.raises(SpecError, match=r"HardwareProfile file .*gpu\.json is not UTF-8 text"):
        load_profile(str(path))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"peak_tflops": {"bf16": 0}}, r"peak_tflops\.bf16 = 0 < 1e-06: a peak must be positive"),
        ({"peak_tflops": {"bf16": -989}}, r"peak_tflops\.bf16 = -989 < 1e-06"),
        (
            {"peak_tflops": {"bf16": 1e300}},
            r"peak_tflops\.bf16 = 1e\+300 > 1000000: more than an exa",
        ),
        ({"matmul_efficiency": 0}, r"matmul_efficiency = 0 < 1e-06: an efficiency is a fraction"),
        ({"memory_efficiency": 1.5}, r"memory_efficiency = 1\.5: Input should be less than or"),
        ({"memory_capacity_gib": 0}, r"memory_capacity_gib = 0 < 0\.001: a memory capacity"),
        ({"memory_bandwidth_GBps": -1}, r"memory_bandwidth_GBps = -1 < 1e-06"),
        (
            {"kernel_overhead_us": 1e12},
            r"kernel_overhead_us = 1000000000000\.0 > 1000000000: more than 1000 s",
        ),
        ({"gpus_per_node": 0}, r"gpus_per_node = 0: Input should be greater than or equal to 1"),
    ],
)
def test_absurd_profile_numbers_are_refused(tmp_path, change, message):
    data = load_profile("h100-sxm-80gb").model_dump(mode="json")
    data.update(change)
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError, match=message):
        load_profile(str(path))


def test_links_refuse_absurd_numbers():
    data = load_profile("h100-sxm-80gb").model_dump(mode="json")
    data["links"]["inter_node"]["busbw_efficiency"] = 0.0
    data["links"]["intra_node"]["bandwidth_GBps"] = 0.0
    with pytest.raises(ValueError) as info:
        HardwareProfile.model_validate(data)
    assert "links.inter_node.busbw_efficiency" in str(info.value)
    assert "links.intra_node.bandwidth_GBps" in str(info.value)


def test_saved_profiles_never_hold_non_finite_numbers(tmp_path):
    profile = load_profile("h100-sxm-80gb").model_copy(update={"matmul_overhead_us": float("nan")})
    with pytest.raises(SpecError, match="matmul_overhead_us is not a finite number"):
        save_profile(profile, tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()

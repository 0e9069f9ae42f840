"""benchmarks/device_bundle.py: files too large for one device call, packed into parts here and joined there."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.fixtures.paths import BENCHMARKS


@pytest.fixture(scope="module")
def bundle():
    spec = importlib.util.spec_from_file_location("device_bundle", os.path.join(BENCHMARKS, "device_bundle.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def files(tmp_path):
    """A nested file and a file named on the way in, 300 kB of incompressible bytes between them."""
    (tmp_path / "src" / "assets").mkdir(parents=True)
    weights, wheel = tmp_path / "src" / "assets" / "model.safetensors", tmp_path / "src" / "pkg.whl"
    weights.write_bytes(os.urandom(200_000))
    wheel.write_bytes(os.urandom(100_000))
    return {"assets/model.safetensors": weights, "wheels/pkg.whl": wheel}


def test_parts_travel_apart_and_join_to_the_same_files(bundle, files, tmp_path, capsys):
    sources = [f"{path}:{name}" for name, path in files.items()]
    assert bundle.main(["pack", *sources, "--out", str(tmp_path / "parts"), "--part-mib", "0.1"]) == 0
    parts = sorted(p for p in os.listdir(tmp_path / "parts") if p.startswith("part-"))
    assert len(parts) == 3 and all(os.path.getsize(tmp_path / "parts" / p) <= 0.1 * (1 << 20) for p in parts)
    assert "3 parts" in capsys.readouterr().out
    assert bundle.main(["unpack", "--parts", str(tmp_path / "parts"), "--to", str(tmp_path / "device")]) == 0
    for name, path in files.items():
        assert (tmp_path / "device" / name).read_bytes() == path.read_bytes(), name


@pytest.mark.parametrize("damage", ["missing", "damaged"])
def test_a_part_lost_or_damaged_on_the_way_is_named_and_nothing_is_extracted(bundle, files, tmp_path, damage):
    bundle.pack([f"{path}:{name}" for name, path in files.items()], str(tmp_path / "parts"), 100_000)
    part = tmp_path / "parts" / "part-001"
    if damage == "missing":
        part.unlink()
    else:
        data = part.read_bytes()
        part.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # always another byte (b"x" was one time in 256)
    with pytest.raises(SystemExit, match=f"part part-001 is {damage}"):
        bundle.unpack(str(tmp_path / "parts"), str(tmp_path / "device"))
    assert not (tmp_path / "device").exists()


def test_a_source_that_is_not_a_file_is_refused(bundle, tmp_path):
    with pytest.raises(SystemExit, match="is not a file"):
        bundle.main(["pack", str(tmp_path / "nowhere.bin"), "--out", str(tmp_path / "parts")])
    assert not (tmp_path / "parts").exists()

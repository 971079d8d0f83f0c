"""The compiled kernels (_ext, built by setup.py) and their Cython seams' sources."""
import importlib.util

# Python run from a checkout imports ktfp8 from there, before an installed copy; unbuilt, the first
# `from ._native import _ext` said only "cannot import name '_ext'".
if importlib.util.find_spec(f"{__name__}._ext") is None:
    raise ImportError(f"ktfp8's compiled kernels are not built in {__path__[0]}: Python is importing ktfp8 "
                      f"from its source folder (the current directory comes first on sys.path).  Run from "
                      f"another folder to use the installed ktfp8, or build this one in place: "
                      f"python setup.py build_ext --inplace (or pip install -e .)")

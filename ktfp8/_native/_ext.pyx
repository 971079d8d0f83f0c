# cython: language_level=3
"""The one seam between Python and the C kernels: typed buffers in, one C call out, GIL released.

No logic lives here; each .pxi below wraps one C header.  Validation happens in the Python modules
that call these functions (ktfp8.fp8, ktfp8.moe, ...).  Test-only native code (the *_emulated
variants, the AMX tile-emulation hook) is in the separate module _testing.pyx."""

include "abi.pxi"
include "cpu.pxi"
include "variants.pxi"
include "codec.pxi"
include "moe.pxi"
include "routing.pxi"
include "probe.pxi"
include "fpenv.pxi"
include "team.pxi"

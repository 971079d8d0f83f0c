"""The converter's option values: --quant-config JSON -> QuantSpec, --max-shard-size text -> bytes."""
import json
import math
import re
from dataclasses import dataclass
from typing import Optional, Tuple

from .config import MAX_BLOCK_EDGE, ODD_BLOCK_EDGE

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class QuantSpec:
    """Target format: per-channel (block None) or block-wise with block = (block_n, block_k)."""
    per_channel: bool
    block: Optional[Tuple[int, int]] = None


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs):
    """json object_pairs_hook: a key given twice is refused (json.loads would keep the last one silently,
    e.g. per_channel true then false), as the safetensors header parser refuses it."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def parse_quant_config(text):
    """--quant-config JSON -> QuantSpec.  Keys: method ("FP8"), per_channel (bool; default true, false where
    a group_size other than 0 is given), group_size (per-channel: 0 or absent; block-wise: the block edge,
    default 128).  A ValueError's message follows argparse's "argument --quant-config: "."""
    try:
        raw = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise ValueError(f"duplicate key {e.args[0]!r}; give each key once: {text!r}") from None
    except (ValueError, RecursionError) as e:      # RecursionError: nested thousands deep
        raise ValueError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"must be a JSON object, got {text!r}")
    unknown = set(raw) - {"method", "per_channel", "group_size"}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}; allowed: method, per_channel, group_size")
    if raw.get("method", "FP8") != "FP8":
        raise ValueError(f"method must be \"FP8\", got {raw.get('method')!r}")
    group = raw.get("group_size")
    if "group_size" in raw and (isinstance(group, bool) or not isinstance(group, int)):
        raise ValueError(f"group_size must be an integer, got {group!r}")
    # a key left out follows the one given, as in ktfp8.QuantConfig: group_size 64 alone is block-wise
    per_channel = raw.get("per_channel", not group)
    if not isinstance(per_channel, bool):
        raise ValueError(f"per_channel must be true or false, got {per_channel!r}")
    if group is None:
        group = 0 if per_channel else 128
    if per_channel:
        if group != 0:
            raise ValueError(f"per_channel needs group_size 0 (one scale per row), got {group}")
        return QuantSpec(True)
    if group <= 0:
        raise ValueError(f"block-wise (per_channel false) needs group_size > 0, got {group}")
    if group > MAX_BLOCK_EDGE:
        raise ValueError(f"group_size must be at most {MAX_BLOCK_EDGE} (the kernels' block edges are 32-bit), "
                         f"got {group}")
    if group % 2:
        raise ValueError(f"group_size must be even, got {group}: {ODD_BLOCK_EDGE}")
    return QuantSpec(False, (group, group))


def parse_size(text):
    """'5GB', '500MB', '2GiB', '1000' -> bytes (decimal units like Hugging Face; KiB/MiB/GiB binary)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m and m[2].upper()
    if not m or unit not in _SIZE_UNITS:
        raise ValueError(f"size {text!r} is not like 5GB, 500MB, 2GiB or a byte count")
    size = float(m[1]) * _SIZE_UNITS[unit]
    if not math.isfinite(size):         # (int() of a float overflow is an OverflowError traceback)
        raise ValueError(f"size {text!r} is too large")
    size = int(size)
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size

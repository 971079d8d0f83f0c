# Sourced by the tuning tools' scripts: isa_flags UNIT prints the compiler flags include/ktfp8/
# variants.def gives an ISA level, those of the levels it extends included (as setup.py reads them),
# so a tool builds its kernels the way the package does.  The table is an X-macro: the C
# preprocessor expands each KTFP8_ISA row to "unit extends flags".
isa_flags() {
    local root unit="$1" rows extends flags out=""
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    rows="$(printf '#define KTFP8_ISA(u, v, e, n, f, o, c, t) u e f\n#include "ktfp8/variants.def"\n' |
            gcc -E -P -I"$root/include" -x c -)"
    while [ "$unit" != none ]; do
        read -r extends flags < <(awk -v u="$unit" '$1 == u { $1 = ""; print; found = 1 } END { exit !found }' <<<"$rows") || {
            echo "isa_flags: no level '$unit' in include/ktfp8/variants.def" >&2
            return 1
        }
        out="${flags//\"/} $out"
        unit="$extends"
    done
    echo $out
}

# package_cflags prints the flags setup.py compiles every unit with (its BASE_CFLAGS), read from
# setup.py itself so that a tool's copy of a kernel cannot drift from the package's build.
package_cflags() {
    local root
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    python3 - "$root/setup.py" <<'PY'
import ast, sys
tree = ast.parse(open(sys.argv[1]).read())
for node in tree.body:
    if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["BASE_CFLAGS"]:
        print(" ".join(ast.literal_eval(node.value)))
        break
else:
    sys.exit("package_cflags: no BASE_CFLAGS list in setup.py")
PY
}

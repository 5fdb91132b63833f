#!/usr/bin/env bash
# Runs FlashAttention's own tests of a suite (PEER_SUITE) against this project. Run from the repository root:
#   PEER_FA_GIT=<bare git dir> [PEER_SUITE=fa4mods|fa3] bash benchmarks/peer_mods/run.sh [--collect-only] [stem ...]
# fa4mods (default): FA4's score_mod / mask_mod / block-sparsity tests (tests/cute) against flash_attn.cute;
# fa3: FA3's hopper/test_flash_attn.py (dense, varlen, KV cache, split, combine) against the top-level
# flash_attn_interface. e.g. `... run.sh test_mask_mod test_score_mod`. See README.md beside this file for the knobs.
# The upstream files go to the git-ignored .peer/<suite>/ and are never committed.
set -uo pipefail

SUITE=${PEER_SUITE:-fa4mods}
case $SUITE in
    fa4mods)
        SRC=tests/cute
        FILES="test_score_mod.py test_mask_mod.py test_score_mod_varlen.py test_mask_mod_varlen.py
               test_block_sparsity.py score_mod_definitions.py mask_mod_definitions.py"
        NAME=peer_mods ;;
    fa3)
        SRC=hopper
        FILES="test_flash_attn.py padding.py test_util.py"
        NAME=peer_fa3 ;;
    *) echo "run.sh: PEER_SUITE must be fa4mods or fa3, got $SUITE" >&2; exit 2 ;;
esac
export PEER_SUITE=$SUITE
DIR=.peer/$SUITE
REF=${PEER_FA_REF:-0251105a}
export OUT=${OUT:-.peer/out}
if [ "${PEER_CONTROL:-0}" = 1 ]; then
    # (FA3 is a CUDA extension built from source: no released build comes with the device bundle)
    [ "$SUITE" = fa4mods ] || { echo "run.sh: PEER_CONTROL=1 runs the released flash-attn-4: fa4mods only" >&2; exit 2; }
    # The control: the same selection against the released flash-attn-4 (PEER_PYTHONPATH of the CuTeDSL bundle's
    # env.sh) alone. The project stays off sys.path (its flash_attn package would shadow the released one); the
    # plugin is loaded from its folder.
    [ -n "${PEER_PYTHONPATH:-}" ] || { echo "run.sh: PEER_CONTROL=1 needs PEER_PYTHONPATH (source /tmp/cutedsl/env.sh)" >&2; exit 2; }
    export PYTHONPATH=$PEER_PYTHONPATH${PYTHONPATH:+:$PYTHONPATH}
    PLUGIN='import sys; sys.path.insert(0, "'$PWD'/benchmarks/peer_mods"); pytest_plugins = ["plugin"]'
    RESULTS=${NAME}_control
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # conftest.py loads benchmarks.peer_mods.plugin from here
    PLUGIN='pytest_plugins = ["benchmarks.peer_mods.plugin"]'
    RESULTS=$NAME
fi
PY=$(command -v python3 || command -v python)

[ -f benchmarks/peer_mods/plugin.py ] || { echo "run.sh: run me from the repository root" >&2; exit 2; }

# Lay out the upstream files, unless they are already there at this ref. On the GPU machine there is no mirror:
# the .peer folder is carried there, so an existing layout is used as it is.
have=$(head -n 1 "$DIR/UPSTREAM" 2>/dev/null)
if [ "$have" != "$REF" ]; then
    if [ -z "${PEER_FA_GIT:-}" ]; then
        [ -n "$have" ] || { echo "run.sh: no $DIR and no PEER_FA_GIT to extract it from" >&2; exit 2; }
        echo "run.sh: no PEER_FA_GIT, using $DIR as laid out (upstream $have, not $REF)"
    else
        # Upstream files must never be committed: refuse to lay them out where git would see them.
        git check-ignore -q "$DIR" || { echo "run.sh: $DIR is not git-ignored (echo /.peer/ >> .git/info/exclude)" >&2; exit 2; }
        mkdir -p .peer
        tmp=$(mktemp -d ".peer/$SUITE.new.XXXXXX")
        for f in $FILES; do
            git --git-dir="$PEER_FA_GIT" show "$REF:$SRC/$f" > "$tmp/$f" \
                || { echo "run.sh: cannot extract $SRC/$f at $REF" >&2; rm -rf "$tmp"; exit 2; }
        done
        { echo "$REF"; git --git-dir="$PEER_FA_GIT" rev-parse "$REF^{commit}"; } > "$tmp/UPSTREAM"
        rm -rf "$DIR" && mv "$tmp" "$DIR"
        echo "run.sh: laid out $DIR from upstream $REF"
    fi
fi
# Ours, rewritten every run. conftest.py: not upstream's (it pins GPUs per worker and logs to /tmp), it only loads
# the plugin. pytest.ini: makes this folder the rootdir, so neither the project's pyproject settings nor any
# conftest.py / pytest.ini above it (.peer/ may hold another harness) applies; the default import mode puts this
# folder on sys.path, as the upstream modules import each other by bare name.
echo "$PLUGIN" > "$DIR/conftest.py"
printf '[pytest]\n# peer_mods: rootdir and conftest boundary (see benchmarks/peer_mods/run.sh)\n' > "$DIR/pytest.ini"

collect_only=${PEER_COLLECT_ONLY:-0}
paths=()
for a in "$@"; do
    case $a in
        --collect-only) collect_only=1 ;;
        *) [ -f "$DIR/${a%.py}.py" ] || { echo "run.sh: no $DIR/${a%.py}.py" >&2; exit 2; }
           paths+=("$DIR/${a%.py}.py") ;;
    esac
done
[ ${#paths[@]} -gt 0 ] || paths=("$DIR")

mkdir -p "$OUT/$RESULTS"
# A module that fails to import must not stop the other files from running.
args=(-c "$DIR/pytest.ini" -p no:cacheprovider --continue-on-collection-errors)
if [ "$collect_only" = 1 ]; then
    args+=(--collect-only -q)
else
    args+=(-q -rA --tb=line --junitxml="$OUT/$RESULTS/junit.xml")
    if "$PY" -c "import xdist" 2>/dev/null; then
        args+=(-n "${PEER_WORKERS:-4}")
    else
        echo "run.sh: pytest-xdist is not installed, running in one process"
    fi
fi
"$PY" -m pytest "${paths[@]}" "${args[@]}" 2>&1
rc=$?
echo "run.sh: pytest exit $rc; summary $OUT/$RESULTS/summary.txt, results.json, items/"
[ -f "$OUT/$RESULTS/summary.txt" ] || echo "run.sh: no summary was written (pytest stopped early?)"
exit $rc

#!/usr/bin/env bash
# Mutation testing of tplower's core modules with cosmic-ray: init, exec, report. Slow; not run in CI.
#
#   mutation/run.sh                      # the five core modules of mutation/cosmic-ray.toml
#   mutation/run.sh src/tplower/core/language/placements.py src/tplower/core/language/transitions.py   # only these
#
# cosmic-ray rewrites each module in place while its tests run, so everything happens in a scratch
# copy of src/ and tests/ (never in this tree). TPLOWER_MUTATION_DIR=<dir> picks the copy; running
# again with the same dir resumes the session where it stopped (exec does only what is left).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${TPLOWER_MUTATION_DIR:-$(mktemp -d -t tplower-mutation-XXXXXX)}
mkdir -p "$work"
if [ ! -f "$work/session.sqlite" ]; then
    rm -rf "$work/src" "$work/tests"
    cp -r "$root/src" "$root/tests" "$root/pyproject.toml" "$work/"
    find "$work" -name __pycache__ -prune -exec rm -rf {} +
    cp "$root/mutation/cosmic-ray.toml" "$work/cosmic-ray.toml"
    if [ $# -gt 0 ]; then
        modules=$(printf '"%s", ' "$@")
        sed -i "s|^module-path = .*|module-path = [${modules%, }]|" "$work/cosmic-ray.toml"
    fi
fi
cd "$work"
export PYTHONPATH="$work/src" OMP_NUM_THREADS=1   # the copy's tplower, not the installed one
if [ ! -f session.sqlite ]; then
    # the unmutated code must pass the test command, or every mutant would count as killed
    cosmic-ray baseline cosmic-ray.toml || { echo "baseline failed: fix the tests first" >&2; exit 1; }
    cosmic-ray init cosmic-ray.toml session.sqlite
    python "$root/mutation/skip_annotations.py" session.sqlite   # equivalent by construction
fi
nice -n 19 cosmic-ray exec cosmic-ray.toml session.sqlite
python "$root/mutation/score.py" session.sqlite --survivors
echo "session: $work/session.sqlite (survivors: cr-report --surviving-only $work/session.sqlite)"

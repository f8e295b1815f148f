#!/bin/bash
# The test suite's time as CI sees it: a fresh clone of HEAD, `make lint vllm-venv`, then
# pytest as make test runs it (TEST_WORKERS, default 2), with every test's duration in a junit
# file. Alone on the machine, please.
#   bash bench/suite_time.sh [CLONE_DIR]   -> CLONE_DIR/suite_time.txt, junit.xml
set -u
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
dir=${1:-/tmp/asyncrl-suite}
rm -rf "$dir" && git clone -q "$repo" "$dir" && cd "$dir" || exit 2
start=$(date +%s)
make lint vllm-venv > setup.log 2>&1
setup=$(date +%s)
/usr/bin/time -v .venv/bin/pytest -q --durations=0 --junitxml=junit.xml -p no:cacheprovider \
    -n "${TEST_WORKERS:-2}" --dist loadfile -m "not alone" > test.log 2>&1
rc=$?
.venv/bin/pytest -q --durations=0 --junitxml=junit-alone.xml -p no:cacheprovider -m alone \
    >> test.log 2>&1 || rc=$?
end=$(date +%s)
summary="$(git rev-parse --short HEAD) rc=$rc setup=$((setup - start))s pytest=$((end - setup))s"
summary="$summary total=$((end - start))s; $(grep -E '[0-9]+ (passed|failed)' test.log | tr '\n' ' ')"
echo "$summary" | tee suite_time.txt
exit $rc

#!/usr/bin/env bash
# The compatibility run (issue 39): the unit suite and the integration proofs that lean on
# torch's internals, on a torch other than the default venv's, in a venv of its own.
#
#   make test-compat TORCH=torch==2.14.1          # or: bash scripts/test-compat.sh torch==2.14.1
#   bash scripts/test-compat.sh --build-only torch==2.11.0   # the venv only
#
# 1. Builds (once; again when the spec or pyproject.toml changed) a venv with that torch
#    first, then the project (`pip install -e '.[dev,etcd,s3]'`), and checks that the
#    project's install left that torch in place (pip's lines about torch are kept).
# 2. Runs tests/unit (not extended), then the integration proofs below, by explicit id.
# 3. Writes benchmarks/results/compat-<torch version>-<date>.md: version x proof, date,
#    commit, pass/fail counts, wall times, pip's evidence (scripts/compat_report.py).
# Exit 0 when every test passed, 1 otherwise (the results file is written either way).
#
# Environment: PYTHON (default python3), COMPAT_VENV (default .venv-compat/<spec>),
# COMPAT_RESULTS (default benchmarks/results). Needs what `make test` needs (etcd,
# Prometheus, root for the multi-host test bed: scripts/install-test-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

# proof | test id. The proofs that lean on torch's agent, rendezvous, DDP and FSDP2
# internals (agent/torch_seams.py, worker/torch_seams.py), and on torchrun's PET_* launch.
PROOFS=(
  "live recovery of a killed worker|tests/integration/test_live_recovery.py::test_sigkilled_workers_are_replaced_in_place_and_the_run_ends_bitwise_exact"
  "live recovery of a killed worker|tests/integration/test_live_recovery.py::test_when_no_worker_survives_the_job_restarts_from_its_checkpoint"
  "exact resume|tests/integration/test_exact_resume.py::test_sigkill_resume_is_bitwise_exact"
  "exact resume|tests/integration/test_exact_resume.py::test_plain_torchrun_survives_a_kill_exactly"
  "a node lost and regained across hosts|tests/integration/test_across_hosts.py::test_etcd_v3_a_killed_host_is_reformed_at_once_and_a_new_host_grows_it_back"
  "a node lost and regained across hosts|tests/integration/test_across_hosts.py::test_c10d_a_node_cut_off_rejoins_when_back_scaling_the_lr[cable]"
  "fsdp kill and reshard|tests/integration/test_sharded_jobs.py::test_fsdp_sigkills_recover_in_place_from_the_checkpoint_bitwise"
  "fsdp kill and reshard|tests/integration/test_sharded_jobs.py::test_a_resize_2_3_2_reshards_and_uses_each_sample_once"
  "an unmodified torchrun script|tests/integration/test_user_scripts.py::test_an_unmodified_script_ends_with_its_status[tutorial-forkserver-sigkill]"
  "an unmodified torchrun script|tests/integration/test_user_scripts.py::test_an_unmodified_script_ends_with_its_status[tutorial-subprocess-sigkill]"
  "the PET_* launch|tests/integration/test_user_scripts.py::test_a_pet_only_launch_gets_torchruns_world[rdzv-id+nproc]"
  "the PET_* launch|tests/integration/test_user_scripts.py::test_a_non_elastic_pytorchjobs_two_nodes_meet_on_the_static_rendezvous"
  "the PET_* launch|tests/integration/test_trainer_v2_launch.py::test_a_trainer_v2_jobs_two_nodes_train_on_the_environment_it_gives"
  "the torch check at start|tests/integration/test_torch_check.py"
)

build_only=0
if [ "${1:-}" = "--build-only" ]; then build_only=1; shift; fi
SPEC="${1:-${TORCH:-}}"
if [ -z "$SPEC" ]; then
  echo "usage: scripts/test-compat.sh [--build-only] TORCH_SPEC (e.g. torch==2.14.1)" >&2
  exit 2
fi
PYTHON="${PYTHON:-python3}"
VENV="${COMPAT_VENV:-.venv-compat/$(printf '%s' "$SPEC" | tr -c 'A-Za-z0-9.' '-')}"
RESULTS="${COMPAT_RESULTS:-benchmarks/results}"
PY="$VENV/bin/python"
if [ ! -f "$VENV/.torch-installed" ] || [ "$(cat "$VENV/.torch-installed")" != "$SPEC" ]; then
  echo "building $VENV with $SPEC"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet "$SPEC"
  echo "$SPEC" > "$VENV/.torch-installed"
fi
project="$(sha256sum pyproject.toml | cut -c1-16) $PWD"
if [ ! -f "$VENV/.project-installed" ] || [ "$(cat "$VENV/.project-installed")" != "$project" ]; then
  evidence="$VENV/install-evidence.txt"
  {
    "$PY" -m pip --version
    echo "\$ pip show torch   # before the project's install"
    "$PY" -m pip show torch | grep -E '^(Name|Version):'
    echo "\$ pip install -e '.[dev,etcd,s3]'   # pip's lines about torch"
  } > "$evidence"
  "$PY" -m pip install -e '.[dev,etcd,s3]' > "$VENV/install-project.log" 2>&1 \
    || { tail -n 20 "$VENV/install-project.log" >&2; exit 1; }
  # torch's own requirement line, and whatever pip installed or uninstalled
  grep -E '^(Requirement already satisfied: |Collecting )torch[<>=!~ ]|^(Installing collected|Successfully installed|Attempting uninstall|  Found existing installation)' \
    "$VENV/install-project.log" >> "$evidence" || true
  {
    echo "\$ pip show torch   # after"
    "$PY" -m pip show torch | grep -E '^(Name|Version):'
  } >> "$evidence"
  before=$(grep -m1 '^Version:' "$evidence")
  after=$(grep '^Version:' "$evidence" | tail -n 1)
  if [ "$before" != "$after" ]; then
    echo "the project's install replaced torch ($before -> $after): see $evidence" >&2
    exit 1
  fi
  echo "$project" > "$VENV/.project-installed"
fi
torch_version=$("$PY" -c 'import torch; print(torch.__version__)')
echo "torch $torch_version in $VENV"
[ "$build_only" = 1 ] && exit 0

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ids=()
: > "$work/proofs.txt"
for entry in "${PROOFS[@]}"; do
  ids+=("${entry#*|}")
  printf '%s\n' "$entry" >> "$work/proofs.txt"
done

# A hard limit around each pytest: a deadlock that holds the GIL (a gloo group's destructor
# joining its thread) also stops pytest-timeout's thread, and would hang the run for good.
status=0
start=$(date +%s)
unit_code=0
timeout --signal=KILL "${COMPAT_UNIT_LIMIT:-1200}" "$PY" -m pytest tests/unit -m "not extended" \
  -p no:cacheprovider -q --junitxml="$work/unit.xml" > "$work/unit.log" 2>&1 || unit_code=$?
tail -n 3 "$work/unit.log"
unit_end=$(date +%s)
proof_code=0
timeout --signal=KILL "${COMPAT_PROOF_LIMIT:-2400}" "$PY" -m pytest "${ids[@]}" \
  -p no:cacheprovider -q --junitxml="$work/proofs.xml" > "$work/proofs.log" 2>&1 || proof_code=$?
tail -n 3 "$work/proofs.log"
end=$(date +%s)
[ "$unit_code" = 0 ] && [ "$proof_code" = 0 ] || status=1
cp "$work/unit.log" "$work/proofs.log" "$VENV/"  # the last run's pytest output, for a look

mkdir -p "$RESULTS"
out="$RESULTS/compat-${torch_version}-$(date -u +%F).md"
"$PY" scripts/compat_report.py --spec "$SPEC" --torch "$torch_version" \
  --unit "$work/unit.xml" --unit-seconds $((unit_end - start)) --unit-code "$unit_code" \
  --proofs "$work/proofs.xml" --proof-list "$work/proofs.txt" --proof-code "$proof_code" \
  --proof-seconds $((end - unit_end)) --evidence "$VENV/install-evidence.txt" \
  --unit-log "$work/unit.log" --proof-log "$work/proofs.log" > "$out"
echo "results: $out"
exit "$status"

#!/usr/bin/env bash
# The whole EDM2 workflow on a toy dataset of coloured shapes, a few minutes on a CPU:
# dataset -> training -> post-hoc EMA -> sampling without and with (auto)guidance -> the training dynamics
# (dashboard, magnitudes, EMA-length sweep of the validation loss).
# Rerunning continues where it stopped. Knobs (environment): PY, DEMO_OUT, DEMO_PRESET, DEMO_NUM,
# DEMO_RES, DEMO_CLASSES, DEMO_DURATION (images; empty = the preset's), DEMO_SEEDS, DEMO_SWEEP_NUM.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python}
OUT=${DEMO_OUT:-demo-out}
PRESET=${DEMO_PRESET:-toy-small}
NUM=${DEMO_NUM:-6000}
RES=${DEMO_RES:-16}
CLASSES=${DEMO_CLASSES:-6}
DURATION=${DEMO_DURATION:-}
SEEDS=${DEMO_SEEDS:-0-63}
SWEEP_NUM=${DEMO_SWEEP_NUM:-256}
STDS=(0.030 0.150)

step() { printf '\n== %s\n' "$*"; }

step "1/5 toy dataset: $NUM images, ${RES}x${RES}, $CLASSES shape classes"
if [ -e "$OUT/toy.zip" ]; then
    echo "$OUT/toy.zip exists; keeping it"
else
    "$PY" dataset_tool.py toy --dest="$OUT/toy.zip" --resolution="$RES" --num="$NUM" --classes="$CLASSES"
fi

step "2/5 training preset $PRESET (Ctrl-C writes a checkpoint and stops the demo; rerun to resume)"
"$PY" train_edm2.py --preset="$PRESET" --data="$OUT/toy.zip" --outdir="$OUT/run" ${DURATION:+--duration="$DURATION"}

step "3/5 post-hoc EMA: sigma_rel ${STDS[*]} from the tracked 0.050 and 0.100 snapshots"
"$PY" reconstruct_phema.py --indir="$OUT/run" --outdir="$OUT/phema" --std="$(IFS=,; echo "${STDS[*]}")"

step "4/5 sampling, 32 Heun steps"
early=$(ls "$OUT"/run/network-snapshot-*-0.050.safetensors | head -n 1)
for std in "${STDS[@]}"; do
    net=$(ls "$OUT"/phema/phema-*-"$std".safetensors | tail -n 1)
    "$PY" generate.py --net="$net" --seeds="$SEEDS" --grid --outdir="$OUT/samples-ema$std"
done
# Autoguidance (paper's follow-up): the early, weaker snapshot of the same run guides the final one.
"$PY" generate.py --net="$net" --gnet="$early" --guidance=2.0 --seeds="$SEEDS" --grid \
    --outdir="$OUT/samples-ema${STDS[-1]}-autoguided"

step "5/5 training dynamics: dashboard, magnitudes, validation loss over 13 EMA lengths"
"$PY" plot_run.py "$OUT/run"
# The sweep's curves: halfway through the training and at its end (paper Figure 5c).
kimgs=()
for f in "$OUT"/run/network-snapshot-*-0.050.safetensors; do
    tag=${f##*network-snapshot-}
    kimgs+=($((10#${tag:0:7})))
done
"$PY" calculate_metrics.py sweep --indir="$OUT/run" --metrics=loss --data="$OUT/toy.zip" --num="$SWEEP_NUM" \
    --std=0.010,0.030,...,0.250 --kimg="${kimgs[$(((${#kimgs[@]} - 1) / 2))]},${kimgs[-1]}"

step "done"
echo "dataset:          $OUT/toy.zip"
echo "training run:     $OUT/run  (log.txt, stats.jsonl, snapshots, training states)"
echo "post-hoc EMA:     $OUT/phema"
for d in "$OUT"/samples-*; do
    echo "image grid:       $d/grid.png"
done
echo "dashboard:        $OUT/run/plots/training.png"
echo "magnitudes:       $OUT/run/plots/magnitudes.png"
echo "EMA-length sweep: $OUT/run/plots/ema-sweep.png"

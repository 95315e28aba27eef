#!/usr/bin/env bash
# Copy the periodic study's rows from runs/ into docs/results/ (what docs/results.md cites), then
# print the tables and draw the figure.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
d=docs/results/periodic_full
mkdir -p $d/matched docs/results/periodic_embedded
cp runs/periodic_full/split0/runs.jsonl $d/growth.jsonl
[ -f runs/periodic_full/split1/runs.jsonl ] && cp runs/periodic_full/split1/runs.jsonl $d/growth_split1.jsonl
[ -f runs/periodic_full25/split0/runs.jsonl ] && cp runs/periodic_full25/split0/runs.jsonl $d/growth_25pct.jsonl
[ -f runs/periodic_full_sp/split0/runs.jsonl ] && cp runs/periodic_full_sp/split0/runs.jsonl $d/growth_shrink_perturb.jsonl
# the study's variants. The 10-epoch anneal: seeds 0-1 (ba9df4c) and seed 2 (ninth session, a folder of its own: another configuration
# fingerprint), and their compute-matched scratch arms (also given the 10-epoch anneal)
[ -f runs/periodic_full_a10/split0/runs.jsonl ] && cat runs/periodic_full_a10/split0/runs.jsonl \
  $(ls runs/periodic_full_a10s2/split0/runs.jsonl 2>/dev/null) > $d/growth_anneal10.jsonl
mkdir -p $d/matched_anneal10
cat $(ls runs/periodic_full_a10/split0/matched/plan.jsonl runs/periodic_full_a10s2/split0/matched/plan.jsonl 2>/dev/null) \
  > $d/matched_anneal10/plan.jsonl
for arm in runs/periodic_full_a10/split0/matched/*/ runs/periodic_full_a10s2/split0/matched/*/; do
  [ -f $arm/runs.jsonl ] && mkdir -p $d/matched_anneal10/$(basename $arm) && cp $arm/runs.jsonl $d/matched_anneal10/$(basename $arm)/runs.jsonl
done
# 25 % of the data with the interval and window counted in optimizer steps (every_n_train_steps, ninth session)
[ -f runs/periodic_full25_steps/split0/runs.jsonl ] && cp runs/periodic_full25_steps/split0/runs.jsonl $d/growth_25pct_steps.jsonl
# a check every epoch (K = 1) or every third (K = 3): seed 0 in the eighth session, seed 1 in the ninth (a folder of
# its own: another configuration fingerprint)
for k in k1 k3; do
  [ -f runs/periodic_full_$k/split0/runs.jsonl ] && cat runs/periodic_full_$k/split0/runs.jsonl \
    $(ls runs/periodic_full_${k}s1/split0/runs.jsonl 2>/dev/null) > $d/growth_$k.jsonl
done
cp runs/periodic_full/split0/matched/plan.jsonl $d/matched/plan.jsonl
for arm in runs/periodic_full/split0/matched/*/; do
  [ -f $arm/runs.jsonl ] && mkdir -p $d/matched/$(basename $arm) && cp $arm/runs.jsonl $d/matched/$(basename $arm)/runs.jsonl
done
for v in runs/periodic_embedded/*/; do [ -f $v/runs.jsonl ] && cp $v/runs.jsonl docs/results/periodic_embedded/$(basename $v).jsonl; done
python experiments/periodic_results.py --sweep docs/results/stopping_full/runs.jsonl --growth $d/growth*.jsonl \
  --matched $d/matched $d/matched_anneal10:growth_anneal10 --converged docs/results/stopping_full/runs.jsonl --figure docs/results/periodic_full.png

# The two towers of train.sh on the model card's held-out sets (seed 1000) under every spec of demo_quality's SPECS;
# three tasks a tower, six processes on one H100. Run on the machine train.sh left warm (/root/runs/aux*).
export PYTHONPATH=/root/sp:$PWD MMKV_CACHE_DIR=/root/mmkvcache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  TORCHINDUCTOR_CACHE_DIR=/root/ind HF_HUB_OFFLINE=1
R=$OUT/res; mkdir -p $R
for W in ${WEIGHTS:-1.0 0.3}; do
  T=/root/runs/aux$W
  python3 -m eval.studies.demo_quality --model demo-internvl --tower $T --n 200 --tasks vqa,doc --device cuda \
    --out $R/aux${W}_dq.json > $R/aux${W}_dq.log 2>&1 &
  python3 -m eval.studies.demo_quality --model demo-internvl --tower $T --n 80 --tasks video --device cuda \
    --out $R/aux${W}_dqv.json > $R/aux${W}_dqv.log 2>&1 &
  python3 -m eval.studies.demo_quality --model demo-internvl --tower $T --n 100 --tasks caption --device cuda \
    --out $R/aux${W}_dqc.json > $R/aux${W}_dqc.log 2>&1 &
done
wait
tar -czf $OUT/eval_res.tar.gz -C $OUT res
python3 - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/res/*.json")):
    d = json.load(open(f))
    for task, by in d.get("tasks", {}).items():
        for spec, r in by.items():
            m = r["metrics"]
            keys = [k for k in m if k in ("exact", "normalized", "ANLS", "CIDEr") or k.endswith(" exact")]
            print(os.path.basename(f), task, spec[:40], {k: round(m[k], 3) for k in keys if isinstance(m[k], float)})
PY
rm -r $OUT/res

# demo-internvl continued alone on one H100 from the shipped packed tower (12.5 min of training beside demo-llava)
# for 6.5 more minutes with the same packed mix plus the training-only position questions (--positions; chain:
# 19 min), then evaluated on the model card's held-out sets
# (seed 1000) under every spec of demo_quality's SPECS, the three tasks in parallel processes. One device call.
export PYTHONPATH=/root/sp:$PWD MMKV_CACHE_DIR=/root/mmkvcache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  TORCHINDUCTOR_CACHE_DIR=/root/ind HF_HUB_OFFLINE=1
MIX="scene=0.4,text=0.15,document=0.3,chart=0.15"
R=$OUT/res; mkdir -p $R
echo "system fonts: $(ls /usr/share/fonts 2>&1 | head -3)"
T=/root/runs/internvl
python3 -m eval.train.towers --model demo-internvl --pack --mix $MIX --batch 48 --workers 14 --save-every 100 \
  --positions --export --out $T --init assets/demo_towers/demo-internvl --minutes ${MINUTES:-6.5} --lr 5e-4 --warmup 50 \
  > $R/train_demo-internvl.log 2>&1
grep "^step" $R/train_demo-internvl.log | tail -2; grep -v "^step\|Loading" $R/train_demo-internvl.log | tail -3
[ -f $T/tower.safetensors ] || { echo "no tower"; exit 1; }
tar -cf $OUT/tower_internvl.tar -C $T tower.safetensors tower.json log.json
python3 -m eval.studies.demo_quality --model demo-internvl --tower $T --n 200 --tasks vqa,doc --device cuda \
  --out $R/internvl_dq.json > $R/internvl_dq.log 2>&1 &
python3 -m eval.studies.demo_quality --model demo-internvl --tower $T --n 80 --tasks video --device cuda \
  --out $R/internvl_dqv.json > $R/internvl_dqv.log 2>&1 &
python3 -m eval.studies.demo_quality --model demo-internvl --tower $T --n 100 --tasks caption --device cuda \
  --out $R/internvl_dqc.json > $R/internvl_dqc.log 2>&1 &
wait
tar -czf $OUT/results.tar.gz -C $OUT res
python3 - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/res/*.json")):
    d = json.load(open(f))
    for task, by in d["tasks"].items():
        for spec, r in by.items():
            m = r["metrics"]
            keys = [k for k in m if k in ("exact", "normalized", "ANLS", "CIDEr") or k.endswith(" exact")]
            print(os.path.basename(f), task, spec[:40], {k: round(m[k], 3) for k in keys if isinstance(m[k], float)})
PY

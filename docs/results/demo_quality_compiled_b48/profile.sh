set -e
bash wip_tw/dev_sh/setup.sh
cd wip_tw
export PYTHONPATH=/root/sp:$PWD MMKV_CACHE_DIR=/root/mmkvcache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/ind TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name --format=csv,noheader
P="python3 -m eval.train.step_profile --steps 16 --warmup 17 --workers 14 --kernels 3 --top 25"
for m in llava internvl; do for c in eager compiled; do
  [ $c = eager ] && f=off || f=on
  s=$(date +%s)
  $P --model demo-$m --compile $f --out $OUT/prof_${m}_$c.json > /tmp/p_${m}_$c.log 2>&1 || { echo "$c $m failed"; tail -n 30 /tmp/p_${m}_$c.log; }
  echo "== $m $c $(( $(date +%s) - s )) s"; grep -v "^Loading" /tmp/p_${m}_$c.log | head -60 | cut -c1-160
done; done

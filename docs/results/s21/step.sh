# Session 21 (issue 26): the decode-step command of sessions 17-18 (window_overlap/h200.sh) again, after session 20's kernel
# changes (paired K bytes, the second key block on spare columns, prefetch span 4); `bash step.sh B ROUNDS LIMIT`.
B=${1:-1} ROUNDS=${2:-3} LIMIT=${3:-300}
export MMKV_CACHE_DIR=$PWD/wip_lead/devcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
SPECS=(--spec "text=kivi:bits=2" --spec "text=xquant:kq=30,vq=2,km=32,vm=16" --spec "text=skvq:k_bits=2,v_bits=1.5,group=64")
timeout $LIMIT python3 -m eval.bench decode --model random:internvl2.5-8b --contexts 32768 --batches $B "${SPECS[@]}" \
  --no-quanto --steps 10 --rounds $ROUNDS --out $OUT/decode_b$B.json 2>&1 | grep -v -i warn | grep -v "kernels:"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader

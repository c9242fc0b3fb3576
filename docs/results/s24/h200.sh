# Session 24: session 18's decode-step command (docs/results/window_overlap/h200.sh), copied here because this session's
# device calls left docs/results/ out of the tree they sent. `bash h200.sh 16 2 520`: batch 16, two rounds.
B=${1:-1} ROUNDS=${2:-3} LIMIT=${3:-300}
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
SPECS=(--spec "text=kivi:bits=2" --spec "text=xquant:kq=30,vq=2,km=32,vm=16" --spec "text=skvq:k_bits=2,v_bits=1.5,group=64")
timeout $LIMIT python3 -m eval.bench decode --model random:internvl2.5-8b --contexts 32768 --batches $B "${SPECS[@]}" \
  --no-quanto --steps 10 --rounds $ROUNDS --out $OUT/h200_decode_b$B.json 2>&1 | grep -v -i warn | grep -v "kernels:"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader

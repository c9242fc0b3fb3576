# Session 18 (issue 26): the decode-step ratios against mmkv fp16 on an H200 again (fp16 at B16 n32768 does not fit
# an H100), now with the window beside the text/SKVQ kernel (MMKV_WINDOW_OVERLAP=1) and SKVQ's unmasked loop
# (MMKV_SKVQ_FULL=1), both defaults; session 17's command (text_unmasked/h200.sh). Two calls on the same warm
# machine: `bash h200.sh 1 3 300` (batch 1, three rounds, h200_b1.txt), then `bash h200.sh 16 2 420` (batch 16,
# two rounds, h200_b16.txt).
B=${1:-1} ROUNDS=${2:-3} LIMIT=${3:-300}
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
SPECS=(--spec "text=kivi:bits=2" --spec "text=xquant:kq=30,vq=2,km=32,vm=16" --spec "text=skvq:k_bits=2,v_bits=1.5,group=64")
timeout $LIMIT python3 -m eval.bench decode --model random:internvl2.5-8b --contexts 32768 --batches $B "${SPECS[@]}" \
  --no-quanto --steps 10 --rounds $ROUNDS --out $OUT/h200_decode_b$B.json 2>&1 | grep -v -i warn | grep -v "kernels:"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader

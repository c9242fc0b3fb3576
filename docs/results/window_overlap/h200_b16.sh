# Session 18 (issue 26): batch 16 of h200.sh (two rounds), on the same warm H200.
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
SPECS=(--spec "text=kivi:bits=2" --spec "text=xquant:kq=30,vq=2,km=32,vm=16" --spec "text=skvq:k_bits=2,v_bits=1.5,group=64")
timeout 420 python3 -m eval.bench decode --model random:internvl2.5-8b --contexts 32768 --batches 16 "${SPECS[@]}" \
  --no-quanto --steps 10 --rounds 2 --out $OUT/h200_decode_b16.json 2>&1 | grep -v -i warn | grep -v "kernels:"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader

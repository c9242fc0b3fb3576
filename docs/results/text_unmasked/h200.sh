# Session 17 (issue 26): the decode-step ratios against mmkv fp16 on an H200 (fp16 at B16 n32768 does not fit an
# H100) with the text kernel's unmasked body for full iterations (MMKV_TEXT_FULL=1), the window's one-tile splits
# (MMKV_WINDOW_TPS=1) and the one-kernel append, all defaults now. A first call with both batches, three rounds and
# --profile ran past its 580 s (h200_timed_out.txt: the tail of its third round); so batch 16 (two rounds) and
# batch 1 (three rounds) run as two processes, without --profile.
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
SPECS=(--spec "text=kivi:bits=2" --spec "text=xquant:kq=30,vq=2,km=32,vm=16" --spec "text=skvq:k_bits=2,v_bits=1.5,group=64")
timeout 330 python3 -m eval.bench decode --model random:internvl2.5-8b --contexts 32768 --batches 16 "${SPECS[@]}" \
  --no-quanto --steps 10 --rounds 2 --out $OUT/h200_decode_b16.json 2>&1 | grep -v -i warn | grep -v "kernels:"
timeout 200 python3 -m eval.bench decode --model random:internvl2.5-8b --contexts 32768 --batches 1 "${SPECS[@]}" \
  --no-quanto --steps 10 --rounds 3 --out $OUT/h200_decode_b1.json 2>&1 | grep -v -i warn | grep -v "kernels:"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader

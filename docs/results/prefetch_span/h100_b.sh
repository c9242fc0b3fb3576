# Session 20 (issue 26), second H100 call: inside the decode step of random:internvl2.5-8b n32768 (variants
# interleaved round by round): XQuant 1.375 at B16 with text prefetch spans 1/4/8, SKVQ K2/V1.5 g64 at B1 with SKVQ
# spans 1/4/8.
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
S="python3 -m eval.studies.step_kernels --context 32768 --base-variants"
F="^## |^\| _text_kernel|^\| _skvq_kernel|^\| _merge|Error|error"
timeout 260 $S --batch 16 --spec "text=xquant:kq=30,vq=2,km=32,vm=16" --rounds 4 \
  --variants "s1:,s4:MMKV_TEXT_PREFETCH_SPAN=4,s8:MMKV_TEXT_PREFETCH_SPAN=8,s1b:,s4b:MMKV_TEXT_PREFETCH_SPAN=4" \
  --out $OUT/step_xquant_b16.json 2>&1 | grep -E "$F" | grep -v -i warn
timeout 200 $S --batch 1 --spec "text=skvq:k_bits=2,v_bits=1.5,group=64" --rounds 6 \
  --variants "s1:,s4:MMKV_SKVQ_PREFETCH_SPAN=4,s8:MMKV_SKVQ_PREFETCH_SPAN=8,s1b:,s4b:MMKV_SKVQ_PREFETCH_SPAN=4" \
  --out $OUT/step_skvq_b1.json 2>&1 | grep -E "$F" | grep -v -i warn
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader

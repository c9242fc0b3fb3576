# Session 18 (issue 26), second H100 call (same warm machine): batch 16 inside the step (XQuant 1.375 overlap on/off;
# SKVQ K2/V1.5 g64 unmasked loop on/off, overlap off) and the SKVQ attention call replayed alone (unmasked on/off).
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
S="python3 -m eval.studies.step_kernels --context 32768 --base-variants --batch 16"
F="^## |^\| _text_kernel|^\| _skvq_kernel|^\| _segment_kernel|^\| _merge|Error|error"
timeout 170 $S --spec "text=xquant:kq=30,vq=2,km=32,vm=16" --rounds 6 \
  --variants "on:,off:MMKV_WINDOW_OVERLAP=0,on2:,off2:MMKV_WINDOW_OVERLAP=0" --out $OUT/step_xquant_b16.json 2>&1 | grep -E "$F" | grep -v -i warn
timeout 220 $S --spec "text=skvq:k_bits=2,v_bits=1.5,group=64" --rounds 6 \
  --variants "new:,masked:MMKV_SKVQ_FULL=0,serial:MMKV_WINDOW_OVERLAP=0,new2:,masked2:MMKV_SKVQ_FULL=0,serial2:MMKV_WINDOW_OVERLAP=0" \
  --out $OUT/step_skvq_b16.json 2>&1 | grep -E "$F" | grep -v -i warn
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader

# Session 16's second call (issue 26): where between 4k and 32k rows one wave stops winning inside the step, and
# SKVQ under the shared rule (kernels/decode/waves.py). One H100, one process per model; lines as in run.sh.
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
S=docs/results/bisect_b16/step_kernels.py
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
A="text=kivi:bits=2|16|16384"; C="text=kivi:bits=2|16|8192"; D="text=kivi:bits=2|4|32768"
K="text=skvq:k_bits=2,v_bits=1.5,group=64|16"
timeout 330 python3 $S "$A|MMKV_TEXT_WAVES=1" "$A|MMKV_TEXT_WAVES=3" "$A|MMKV_TEXT_WAVES=1" "$A|MMKV_TEXT_WAVES=3" \
  "$C|MMKV_TEXT_WAVES=1" "$C|MMKV_TEXT_WAVES=3" "$D|MMKV_TEXT_WAVES=1" "$D|MMKV_TEXT_WAVES=3" \
  "$K|32768|" "$K|32768|MMKV_SKVQ_WAVES=1" "$K|4096|" "$K|4096|MMKV_SKVQ_WAVES=3" 2>&1 | grep -v -i warn
M="text=kivi:bits=2|16"; N="text=kivi:bits=2|64|4096"
MODEL=random:smollm2-135m timeout 150 python3 $S "$M|16384|MMKV_TEXT_WAVES=1" "$M|16384|MMKV_TEXT_WAVES=3" \
  "$M|8192|MMKV_TEXT_WAVES=1" "$M|8192|MMKV_TEXT_WAVES=3" "$N|MMKV_TEXT_WAVES=1" "$N|MMKV_TEXT_WAVES=3" \
  "$M|32768|" 2>&1 | grep -v -i warn
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader

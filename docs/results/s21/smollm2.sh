# Session 21 (issue 26): SmolLM2 heads (head_dim 64, 9q/3kv), the 3x target at B16 n32768 (KIVI-2 2.80x in session
# 20): natural order under the L2 prefetch (now one request per 4 iterations), 4 warps and the vector scale loads,
# then tile order (post-scaled values) at head_dim 64 (MMKV_KIVI_TILES=all), each setting on the same inputs.
export MMKV_CACHE_DIR=$PWD/wip_lead/devcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
B="python3 -m eval.bench.text_attention --layouts smollm2 --contexts 32768 --batches 16,64 --no-baselines"
timeout 250 $B --ab "MMKV_TEXT_PREFETCH:MMKV_TEXT_WARPS:MMKV_TEXT_SVEC=0:2:0,1:2:0,2:2:0,0:4:0,1:4:0,0:2:1" \
  --out $OUT/smol_natural.json 2>&1 | grep -v -i warn | tail -12
MMKV_KIVI_TILES=all timeout 200 $B --ab "MMKV_TEXT_PREFETCH:MMKV_TEXT_WARPS=0:2,1:2,0:4,1:4" \
  --out $OUT/smol_tiles.json 2>&1 | grep -v -i warn | tail -12

# Session 19 (issue 26): SKVQ K2/V1.5 g64 at batch 1 with 2-warp programs and the L2 prefetch (the new
# defaults below 32 (row, KV head) pairs from 16k tokens): the call replayed alone (new vs both off), then the
# decode step against mmkv fp16 (session 18's command, KIVI-2 beside SKVQ, four rounds).
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
timeout 170 python3 -m eval.bench.skvq_attention --groups 64 --variants var --graphs --shapes internvl2.5-8b,smollm2-135m \
  --tokens 32768 --batches 1 --ab "new:,old:MMKV_SKVQ_WARPS=4;MMKV_SKVQ_PREFETCH=0" --out $OUT/call_b1.json 2>&1 \
  | grep -E "^\| .*(sdpa|K2V1.5)|Error" | grep -v -i warn
timeout 360 python3 -m eval.bench decode --model random:internvl2.5-8b --contexts 32768 --batches 1 \
  --spec "text=kivi:bits=2" --spec "text=skvq:k_bits=2,v_bits=1.5,group=64" --no-quanto --steps 10 --rounds 4 --out $OUT/decode_b1.json 2>&1 \
  | grep -v -i warn | grep -v "kernels:"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader

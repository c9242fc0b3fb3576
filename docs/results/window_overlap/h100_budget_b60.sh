# Session 18 (issue 26), on the same warm H100 after h100_a.sh / h100_b.sh (their kernels):
#  1. the text budget (XQuant 40 GB was 4.59x fp16, 5x target), two rounds;
#  2. XQuant's batch 60 (its 40 GB batch): the text kernel's waves and L2 prefetch inside the step (one variant's
#     graph alive at a time: B60 x 32k with six graphs did not fit 80 GB) and replayed alone.
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
python3 -m eval.bench budget --model random:internvl2.5-8b --visual 0 --text 32768 --budgets 20,40 \
  --spec "text=kivi:bits=2" --spec "text=xquant:kq=30,vq=2,km=32,vm=16" --rounds 2 --out $OUT/h100_budget_text.json
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -m eval.studies.step_kernels --context 32768 --base-variants --sequential --batch 60 \
  --spec "text=xquant:kq=30,vq=2,km=32,vm=16" --rounds 3 \
  --variants "plan:,w6:MMKV_TEXT_WAVES=6,w8:MMKV_TEXT_WAVES=8,pf0:MMKV_TEXT_PREFETCH=0,pf2:MMKV_TEXT_PREFETCH=2,plan2:" \
  --out $OUT/step_xquant_b60.json
python3 -m eval.bench.text_attention --layouts internvl2.5-8b --contexts 32768 --batches 60 --no-baselines \
  --ab MMKV_TEXT_WAVES=,6,8 --ab MMKV_TEXT_PREFETCH=,0,2 --out $OUT/text_b60.json
# later, a fresh H100 start: the window's one-tile splits (MMKV_WINDOW_TPS, measured at B1/B16 only) at B60
python3 -m eval.studies.step_kernels --context 32768 --base-variants --sequential --batch 60 \
  --spec "text=xquant:kq=30,vq=2,km=32,vm=16" --rounds 4 \
  --variants "plan:,wt0:MMKV_WINDOW_TPS=0,plan2:,wt02:MMKV_WINDOW_TPS=0" --out $OUT/step_xquant_b60_window.json

# Session 21 (issue 28): the demo's short answers when the question reads the stored visual cache (--after-media)
# beside the papers' protocol (the question's attention exact), the same held-out questions (seed 1000), CPU.
export MMKV_CACHE_DIR=${MMKV_CACHE_DIR:-$PWD/wip_lead/mmkvcache} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-docs/results/after_media}
M=${1:-demo-llava} N=${2:-60}
S=(--spec fp16 --spec "visual=calibquant:bits=1" --spec "visual=calibquant:bits=1,calibrate=false"
   --spec "visual=calibquant:bits=2" --spec "visual=kivi:bits=2" --spec "visual=calibquant:bits=4")
[ -f $OUT/${M}_vqa_n${N}.json ] || ${PY:-python} -m eval.studies.demo_quality --model $M --tasks vqa --n $N \
  --device cpu --batch 16 "${S[@]}" --out $OUT/${M}_vqa_n${N}.json
${PY:-python} -m eval.studies.demo_quality --model $M --tasks vqa --n $N --device cpu --after-media "${S[@]}" \
  --out $OUT/${M}_vqa_n${N}_after_media.json

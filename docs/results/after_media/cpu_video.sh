# Session 22 (issue 28): video QA when the question reads the stored visual cache (--after-media) beside the papers'
# protocol, the same held-out clips (seed 1000), CPU; demo-internvl (the model the app gives video to) by default.
export MMKV_CACHE_DIR=${MMKV_CACHE_DIR:-$PWD/wip_lead/mmkvcache} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-docs/results/after_media}
M=${1:-demo-internvl} N=${2:-10}
S=(--spec fp16 --spec "visual=calibquant:bits=1" --spec "visual=calibquant:bits=1,calibrate=false"
   --spec "visual=calibquant:bits=2" --spec "visual=kivi:bits=2" --spec "visual=calibquant:bits=4")
[ -f $OUT/${M}_video_n${N}.json ] || ${PY:-python} -m eval.studies.demo_quality --model $M --tasks video --n $N \
  --device cpu --batch 4 "${S[@]}" --out $OUT/${M}_video_n${N}.json
${PY:-python} -m eval.studies.demo_quality --model $M --tasks video --n $N --device cpu --after-media "${S[@]}" \
  --out $OUT/${M}_video_n${N}_after_media.json

# Session 21 (issue 28): the demo's short answers when the question reads the stored visual cache (--after-media)
# beside the papers' protocol (the question's attention exact), the same held-out questions (seed 1000), CPU.
# Session 22: the task and the first protocol's batch as arguments 3 and 4 (`demo-internvl 10 video 4`: clips).
export MMKV_CACHE_DIR=${MMKV_CACHE_DIR:-$PWD/wip_lead/mmkvcache} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-docs/results/after_media}
M=${1:-demo-llava} N=${2:-60} T=${3:-vqa} B=${4:-16}
S=(--spec fp16 --spec "visual=calibquant:bits=1" --spec "visual=calibquant:bits=1,calibrate=false"
   --spec "visual=calibquant:bits=2" --spec "visual=kivi:bits=2" --spec "visual=calibquant:bits=4")
[ -f $OUT/${M}_${T}_n${N}.json ] || ${PY:-python} -m eval.studies.demo_quality --model $M --tasks $T --n $N \
  --device cpu --batch $B "${S[@]}" --out $OUT/${M}_${T}_n${N}.json
${PY:-python} -m eval.studies.demo_quality --model $M --tasks $T --n $N --device cpu --after-media "${S[@]}" \
  --out $OUT/${M}_${T}_n${N}_after_media.json

# Session 21 (issue 28): documents (DocVQA-style ANLS) with the question sent with its image and read over the stored
# cache (--after-media), the same held-out questions (seed 1000), CPU: `bash cpu_doc.sh MODEL N`.
export MMKV_CACHE_DIR=${MMKV_CACHE_DIR:-$PWD/wip_lead/mmkvcache} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-docs/results/after_media}
M=${1:-demo-llava} N=${2:-40}
S=(--spec fp16 --spec "visual=calibquant:bits=1" --spec "visual=calibquant:bits=2" --spec "visual=kivi:bits=2"
   --spec "visual=calibquant:bits=4")
for A in "" --after-media; do
  ${PY:-python} -m eval.studies.demo_quality --model $M --tasks doc --n $N --device cpu --batch 16 $A "${S[@]}" \
    --out $OUT/${M}_doc_n${N}${A:+_after_media}.json
done

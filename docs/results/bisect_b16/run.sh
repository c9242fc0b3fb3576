# The batch-16 KIVI-2 decode step of random:internvl2.5-8b at 32k, the L2-prefetch commit (0bbe89f, extracted with
# `git archive 0bbe89f mmkv kernels eval pyproject.toml` into wip_old/) and main, one after the other in separate
# processes on one GPU, each preceded by the GPU's clocks: was the H200's 12.49 -> 13.86 ms a code change or a
# machine's? (fp16 at batch 16 does not fit on an 80 GB H100 and is skipped there; the quantized step is timed.)
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
Q="--model random:internvl2.5-8b --contexts 32768 --batches 16 --spec text=kivi:bits=2 --no-quanto --steps 10"
# ORDER: main (this tree) or the NAME of a wip_NAME/ tree made the same way (its COMMIT file says which commit); a tag
# may end in @VAR=value to run that tree with one environment switch set (main@MMKV_TEXT_WAVES=0).
for tag in ${ORDER:-old main}; do
  name=${tag%%@*}; sw=; [ "$name" != "$tag" ] && sw=${tag#*@}
  d=$PWD; [ $name != main ] && d=$PWD/wip_$name
  echo "$tag $(nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader)"
  (cd $d && env $sw PYTHONPATH=$d timeout 240 python3 -m eval.bench decode $Q --out $OUT/bisect_${tag//[@=]/_}.json \
    2>&1 | grep "b= 16 text=kivi" | tail -1)
done
echo "end $(nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader)"

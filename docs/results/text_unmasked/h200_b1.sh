# Session 17 (issue 26): batch 1 of h200.sh again, alone (its process there ran past 200 s in the third round; that
# call's partial rounds are in h200.txt), on the same warm H200.
export MMKV_CACHE_DIR=$PWD/wip_lead/mmkvcache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
timeout 270 python3 -m eval.bench decode --model random:internvl2.5-8b --contexts 32768 --batches 1 \
  --spec "text=kivi:bits=2" --spec "text=xquant:kq=30,vq=2,km=32,vm=16" --spec "text=skvq:k_bits=2,v_bits=1.5,group=64" \
  --no-quanto --steps 10 --rounds 3 --out $OUT/h200_decode_b1.json 2>&1 | grep -v -i warn | grep -v "kernels:"

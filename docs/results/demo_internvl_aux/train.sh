# demo-internvl from its 12.5-minute packed tower (commit 8892217's assets/demo_towers/demo-internvl, carried as
# wip_lead/base_internvl), 6.5 more minutes with the position questions, as the shipped tower was made, plus the
# position heads (--aux W --aux-kinds position: each token's row and column read linearly from the projector's
# input), two weights side by side on one H100 (7 data workers each). Chain: 19 minutes. One device call; eval.sh
# evaluates the two towers in the next. Environment (defaults: the thirteenth session's runs): WEIGHTS ("1.0 0.3"),
# AUXKINDS (position; the fourteenth session also ran place), AUXAT (input; then output), ATTN (sdpa), MINUTES,
# BASE (the tower to start from).
export PYTHONPATH=/root/sp:$PWD MMKV_CACHE_DIR=/root/mmkvcache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  TORCHINDUCTOR_CACHE_DIR=/root/ind HF_HUB_OFFLINE=1
MIX="scene=0.4,text=0.15,document=0.3,chart=0.15"
R=$OUT/res; mkdir -p $R
for W in ${WEIGHTS:-1.0 0.3}; do
  python3 -m eval.train.towers --model demo-internvl --pack --mix $MIX --batch 48 --workers 7 --save-every 100 \
    --positions --aux $W --aux-kinds ${AUXKINDS:-position} --aux-at ${AUXAT:-input} --attention ${ATTN:-sdpa} --export --out /root/runs/aux$W --init ${BASE:-wip_lead/base_internvl} \
    --minutes ${MINUTES:-6.5} --lr 5e-4 --warmup 50 > $R/train_aux$W.log 2>&1 &
done
wait
for W in ${WEIGHTS:-1.0 0.3}; do
  grep "^step" $R/train_aux$W.log | tail -2; grep -v "^step\|Loading" $R/train_aux$W.log | tail -3
  [ -f /root/runs/aux$W/tower.safetensors ] && cp /root/runs/aux$W/tower.safetensors $OUT/tower_aux$W.safetensors
  cp /root/runs/aux$W/tower.json $R/tower_aux$W.json 2>/dev/null; cp /root/runs/aux$W/log.json $R/log_aux$W.json 2>/dev/null
done
tar -czf $OUT/train_res.tar.gz -C $OUT res && rm -r $OUT/res

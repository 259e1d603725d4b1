#!/usr/bin/env bash
# The compare.py rows of issues 15 and 16 on the H200, in two commands of under nine
# minutes each (docs/throughput.md, "Other models"):
#
#   bash benchmarks/model_rows.sh llama3_8b     # stock torch.compile + dataflow 16, 8 GiB by layer
#                                               # (LLAMA_PART=16: stock, 16 GiB; 8: 8 GiB alone)
#   bash benchmarks/model_rows.sh llama3_8b_lora  # issue 48: LoRA rank 16, stock PEFT compile + dataflow 16, 8 GiB
#                                               # (LORA_PART=16: stock, 16 GiB; 8: 8 GiB alone)
#   bash benchmarks/model_rows.sh l3_1b         # stock + dataflow 4 GiB by layer (L3_ORDERS)
#   bash benchmarks/model_rows.sh olmoe         # stock + dataflow 16, 8 GiB, layer order first
#   bash benchmarks/model_rows.sh small         # l3_1b then olmoe (two commands' worth)
#   bash benchmarks/model_rows.sh olmoe16       # issue 16's row: stock + 16 GiB by layer, 262,144 tokens
#   bash benchmarks/model_rows.sh gpt2          # issue 13/14: stock compile + dataflow 16..1 GiB
#                                               # (GPT2_PART=big: stock, 16..2 GiB; small: 1 GiB)
#   bash benchmarks/model_rows.sh qwen3_5       # issue 46: qwen3_5_cut, stock compile + dataflow 16, 8 GiB
#   bash benchmarks/model_rows.sh qwen3_5_moe   # issue 46: qwen3_5_moe_cut, the same
#   DS_PRESETS=deepseek_v3_cut bash benchmarks/model_rows.sh deepseek
#                                               # issue 47: stock compile + dataflow 16, 8 GiB of
#                                               # deepseek_v3_cut, deepseek_v32_cut, glm5_cut (one
#                                               # call each; an H200 on a host of over 128 GiB,
#                                               # or DS_DTYPES=bf16-int8; moonlight_16b_a3b: the
#                                               # whole 16B at 16 GiB, dataflow with int8 moments)
#   LARGE_PART=14b bash benchmarks/model_rows.sh large  # issue 50: qwen3_14b 16 GiB (int8 moments)
#                                               # beside stock compile + checkpointing; LARGE_PART=
#                                               # long-stock: stock's longest llama3_8b sequence;
#                                               # long: dataflow llama3_8b at 131,072 in 16 GiB
#
# Rows are appended to benchmarks/results/compare.json and the tables of
# docs/throughput.md rewritten; with $OUT set, the log, both files and the profile cache
# (one tarball: put it at benchmarks/results/profiles_<group>.tgz to reuse it in a later
# run) are copied there. SMOKE=1 runs the same commands on the CPU at tiny presets
# (llama3_tiny, olmoe_tiny; the deepseek group's *_tiny) into /tmp, so nothing fails on the
# device for a typo.
set -u
group=${1:?usage: model_rows.sh llama3_8b|llama3_8b_lora|l3_1b|olmoe|olmoe16|olmoe8|small|gpt2|qwen3_5|qwen3_5_moe|deepseek|large}
out_json=benchmarks/results/compare.json
page=docs/throughput.md
cache=/tmp/dataflow_profiles_$group
common=(--append --stock-dtypes bf16 --dataflow-dtypes bf16 --no-checkpoint-row)
if [ "${SMOKE:-0}" = 1 ]; then
    smoke=/tmp/model_rows_smoke
    mkdir -p "$smoke"
    cp "$out_json" "$smoke/compare.json"
    cp "$page" "$smoke/throughput.md"
    out_json=$smoke/compare.json page=$smoke/throughput.md cache=$smoke/profiles
    common+=(--device cpu --compile-backend eager --resolver torch)
    moe_resolver=torch
    big=(--preset llama3_tiny --seq-len 32) dense=(--preset llama3_tiny --seq-len 32)
    moe=(--preset olmoe_tiny --seq-len 32)
    big_budgets=4MiB,2MiB dense_budget=2MiB moe_budgets=4MiB,2MiB
    big_tokens=256 tokens=256 olmoe16_tokens=1024 backing=${BACKING:-64MiB}
    lora_batches=2 lora_backing=()
    gpt2=(--preset gpt2_tiny --seq-len 32) gpt2_tokens=512 gpt2_big=4MiB,2MiB gpt2_two=1MiB
    gpt2_small=512KiB
    q35=(--preset qwen3_5_tiny --seq-len 32) q35moe=(--preset qwen3_5_moe_tiny --seq-len 32)
    ds_seq=32 ds_batches16=2 ds_batches8=2
else
    common+=(--resolver torch-compiled)
    moe_resolver=${MOE_RESOLVER:-torch-compiled}
    big=(--preset llama3_8b --seq-len 4096) dense=(--preset l3_1b --seq-len 4096)
    moe=(--preset olmoe_1b_7b --seq-len 4096)
    big_budgets=16GiB,8GiB dense_budget=4GiB moe_budgets=16GiB,8GiB
    big_tokens=131072 tokens=131072 olmoe16_tokens=262144 backing=${BACKING:-}
    lora_batches=${LORA_BATCHES:-4,2} lora_backing=(--backing "${LORA_BACKING:-90GiB}")
    gpt2=(--preset gpt2_124m --seq-len 1024) gpt2_tokens=524288
    gpt2_big=16GiB,8GiB,4GiB gpt2_two=2GiB gpt2_small=1GiB
    q35=(--preset qwen3_5_cut --seq-len 4096) q35moe=(--preset qwen3_5_moe_cut --seq-len 4096)
    ds_seq=4096 ds_batches16=16,8 ds_batches8=8,4
fi
# REDO=1 measures again the rows the results already have (--redo), e.g. the first call
# after a change to what the rows run; later calls without it measure only what is missing
[ "${REDO:-0}" = 1 ] && common+=(--redo)
# TRACES=DIR: each dataflow row's profiled step and simulated step go there (compare.py
# --trace-dir), to see which transfers and tasks the prediction got wrong
[ -n "${TRACES:-}" ] && common+=(--trace-dir "$TRACES")
export DATAFLOW_PROFILE_CACHE=$cache PYTHONUNBUFFERED=1
saved=benchmarks/results/profiles_$group.tgz
# olmoe16 and olmoe8 run the olmoe group's tasks: their saved profiles serve them
case $group in olmoe?*) [ -f "$saved" ] || saved=benchmarks/results/profiles_olmoe16.tgz ;; esac
# the LoRA rows share the full step's attention, norms and head: llama3_8b's profiles
# serve what they can (a task the archive lacks, or one of older code, is profiled again)
case $group in llama3_8b_lora) [ -f "$saved" ] || saved=benchmarks/results/profiles_llama3_8b.tgz ;; esac
[ -f "$saved" ] && mkdir -p "$cache" && tar xzf "$saved" -C "$cache"
# BACKING=SIZE gives every row a slow budget; llama3_8b's rows set their own (below: an
# 8B plan's pool without one outgrows the host's 128 GiB)
[ -n "$backing" ] && common+=(--backing "$backing")
compare() { python -m benchmarks.compare "${common[@]}" --out "$out_json" --doc "$page" "$@"; }
# with $OUT set, the results as they grow are copied there every 15 s too (compare.py saves
# after each row): a call cut at the device's time limit still returns its finished rows
if [ -n "${OUT:-}" ]; then
    ( while sleep 15; do cp "$out_json" "$OUT/" 2>/dev/null; done ) &
    copier=$!
    trap 'kill "$copier" 2>/dev/null' EXIT
fi
log=${OUT:-/tmp}/model_rows_$group.log
case $group in
llama3_8b)
    # stock: torch.compile at batch 2 x 4096 (issue 15's fastest stock setup). dataflow at
    # 16 and 8 GiB: batch 2 x 16 rounds. Sessions 5-7 ran 16 GiB in round order inside a
    # 95 GiB backing budget (the host has 128 GiB; an unlimited plan's pool is larger).
    # Session 21, on the CPU with the H200 profile archive (benchmarks/place_llama3_8b.py
    # --budget B --order O --batch 2 --rounds 16 --updates early --backing S
    # --workspace llama3.embed.backward=403MB, the embedding's row gradient since session
    # 17): 16 GiB round 13.080 s (905 GB over the link a step), layer:2 12.912 s (520 GB),
    # layer:4 13.104 s, all inside 95 GiB; so 16 GiB runs layer:2. At 8 GiB, layer:8
    # without a backing budget plans 13.474 s with a 137 GiB pool, which the host cannot
    # page-lock, and inside 90 GiB it cannot be planned (its smallest budget is 5.34 GiB
    # of the 4.91 left beside the head's workspace); layer:4 inside 90 GiB plans 13.390 s
    # with an 89.8 GiB pool, so 8 GiB runs that
    {
        big16=(--dataflow-orders "${ORDER16:-layer:2}" --updates early --budgets "${big_budgets%,*}")
        big8=(--dataflow-orders "${ORDER8:-layer:4}" --budgets "${big_budgets#*,}")
        if [ "${SMOKE:-0}" != 1 ]; then
            big16+=(--backing "${BACKING16:-95GiB}")
            big8+=(--backing "${BACKING8:-90GiB}")
        fi
        # LLAMA_PART=16 runs stock and the 16 GiB row, LLAMA_PART=8 the 8 GiB row alone
        # (its ratio is to the stock row already in the results), each with the call to
        # itself: in session 23 the 16 GiB row's load and first step outlasted the 237 s
        # that row had left beside the stock row and the 8 GiB one (default: both parts)
        part=${LLAMA_PART:-both}
        if [ "$part" = 16 ]; then row16=(--row-seconds 440 --total-seconds 540)
        else row16=(--row-seconds 280 --total-seconds 330); fi
        [ "$part" = 8 ] || compare --family llama3 "${big[@]}" --rows stock,dataflow \
            --stock-engines compile --batches 2 --dataflow-batches 2 \
            --min-tokens "$big_tokens" "${big16[@]}" --steps 3 --warmup 1 \
            --compile-row-seconds 200 "${row16[@]}"
        [ "$part" = 16 ] && exit 0
        if [ "$part" = 8 ]; then row8=(--row-seconds 540 --total-seconds 540)
        else row8=(--row-seconds 230 --total-seconds 230); fi
        # 8 GiB: the head is not tiled (session 17: by layer:8 tiling planned 14.559 s
        # against 14.435); HEAD_TILES=1 adds --head-vocab-tiles should the device refuse
        # to place it
        tiles=()
        [ "${HEAD_TILES:-0}" = 1 ] && tiles=(--head-vocab-tiles)
        compare --family llama3 "${big[@]}" --rows dataflow --dataflow-batches 2 \
            --min-tokens "$big_tokens" "${big8[@]}" \
            "${tiles[@]}" --steps 3 --warmup 1 "${row8[@]}"
    } 2>&1 | tee "$log"
    ;;
llama3_8b_lora)
    # issue 48: LoRA rank 16 (alpha 32, q,k,v,o,gate,up,down: dataflow's default targets)
    # at 4096 tokens a sequence. Stock: the transformers LlamaForCausalLM under PEFT LoRA,
    # torch.compile, bf16 base and adapters, SDPA, fused AdamW over the adapters, at the
    # faster of batch 4 and 2 (LORA_BATCHES; harness/stock_lora.py), no memory limit.
    # dataflow: batch 2 x 16 rounds (131,072 tokens, as the full rows it is set beside),
    # inside a 90 GiB slow budget (LORA_BACKING; the host has 128 GiB), 16 GiB in round
    # order (LORA_ORDER16) and 8 GiB by layer:4 (LORA_ORDER8). Session 30 planned them on
    # the CPU with the roofline's H200 costs (compile_step, recompute on, that backing):
    # 16 GiB round 7.45 s a step (slow pool 13.8 GiB, 115 GB over the link), layer:2 the
    # same 7.45 s with a 31.4 GiB pool; 8 GiB round 12.32 s (312 GB moved), layer:2
    # 8.02 s (193 GB, a 34.8 GiB pool), layer:4 7.77 s (178 GB, a 56.2 GiB pool).
    # Targets: the 16 GiB row >= 0.95x the stock LoRA row, each budget's row >= 1.3x
    # dataflow's full-training row of that budget.
    # The whole group is one call of under nine minutes; LORA_PART=16 runs stock and
    # 16 GiB, LORA_PART=8 the 8 GiB row alone (its ratio is to the stock row already in
    # the results), each with the call to itself, should the first call run out of time
    {
        lora=(--mode lora --lora-rank 16 --dataflow-batches 2 --min-tokens "$big_tokens"
            "${lora_backing[@]}" --steps 3 --warmup 1)
        part=${LORA_PART:-both}
        if [ "$part" = 16 ]; then row16=(--row-seconds 300 --total-seconds 540)
        else row16=(--row-seconds 200 --total-seconds 330); fi
        [ "$part" = 8 ] || compare --family llama3 "${big[@]}" "${lora[@]}" \
            --rows stock,dataflow --stock-engines compile --batches "$lora_batches" \
            --compile-row-seconds 150 --budgets "${big_budgets%,*}" \
            --dataflow-orders "${LORA_ORDER16:-round}" "${row16[@]}"
        [ "$part" = 16 ] && exit 0
        if [ "$part" = 8 ]; then row8=(--row-seconds 540 --total-seconds 540)
        else row8=(--row-seconds 200 --total-seconds 200); fi
        compare --family llama3 "${big[@]}" "${lora[@]}" --rows dataflow \
            --budgets "${big_budgets#*,}" --dataflow-orders "${LORA_ORDER8:-layer:4}" "${row8[@]}"
    } 2>&1 | tee "$log"
    ;;
l3_1b | olmoe | small)
    {
        # l3_1b at 4 GiB: by layer, batch 4 then 2 (benchmarks/plan_rows.py, session 21:
        # 4 x 8 by layer plans 2.504 s, 2 x 16 2.545 s, 4 x 8 in round order 2.736 s, 8 x 4
        # cannot be planned beside its head's workspace; session 19's round-order row ran out
        # of row time). L3_ORDERS=round,layer measures round order too
        if [ "$group" != olmoe ]; then
            compare --family llama3 "${dense[@]}" --rows stock,dataflow --stock-engines compile \
                --batches 8,4 --dataflow-batches 4,2 --dataflow-batch-order given \
                --min-tokens "$tokens" --budgets "$dense_budget" \
                --dataflow-orders "${L3_ORDERS:-layer}" --steps 4 --warmup 2 \
                --compile-row-seconds 120 --row-seconds 110 --total-seconds 360
        fi
        # the MoE stock row is the grouped-GEMM model under torch.compile (issue 16); the
        # dataflow tasks compiled too (the bf16 compiled MoE GPU tests passed in session 9:
        # the grouped GEMM over device offsets is captured; MOE_RESOLVER=torch runs them
        # eager, as sessions 6-8 did), the step replayed from a CUDA graph either way. Layer order first: by the roofline it
        # is 1.35x (16 GiB) and 2x (8 GiB) round order's tokens/s, the experts' weights
        # crossing the link once a step each way instead of once a round. A layer-order
        # row's setup took 78 s on the H200 (session 6), its whole row 124 s; with --append
        # the rows already measured are kept and the rest run. MOE_TOKENS sets the dataflow
        # rows' tokens a step (default 131,072): by the roofline (`dataflow predict --family
        # olmoe --preset olmoe_1b_7b --hw h200 --t-round 16384 --tokens-step N --budget 16
        # --seq-len 4096 --order layer`, session 9) layer order at 16 GiB gives 41,551,
        # 51,784 and 60,058 tok/s at 131,072, 262,144 and 524,288 tokens (the experts' weights
        # and AdamW state cross the link once a step, over more tokens), with a slow pool of
        # 78, 99 and 103 GiB. The stock row takes an optimizer step every batch either way
        if [ "$group" != l3_1b ]; then
            compare --family olmoe "${moe[@]}" --rows stock,dataflow --stock-engines compile \
                --resolver "$moe_resolver" --dataflow-orders layer,round \
                --batches 4,2 --dataflow-batches 4,2 --min-tokens "${MOE_TOKENS:-$tokens}" \
                --budgets "$moe_budgets" \
                --steps 4 --warmup 2 --compile-row-seconds 130 \
                --row-seconds 230 --total-seconds 490
        fi
    } 2>&1 | tee "$log"
    ;;
olmoe16)
    # issue 16's target row alone: stock torch.compile at batch 4 beside dataflow at 16 GiB
    # by layer, 4 x 16 rounds (262,144 tokens a step; session 18 measured it at 339 s, its
    # dataflow setup about 80 s: the row limit is what session 19's hand-run call lacked)
    {
        compare --family olmoe "${moe[@]}" --rows stock,dataflow --stock-engines compile \
            --resolver "$moe_resolver" --dataflow-orders layer --batches 4 --dataflow-batches 4 \
            --min-tokens "$olmoe16_tokens" --budgets "${moe_budgets%,*}" --steps 4 --warmup 2 \
            --compile-row-seconds 130 --row-seconds 330 --total-seconds 480
    } 2>&1 | tee "$log"
    ;;
olmoe8)
    # issue 16's 8 GiB row alone: dataflow by layer at batch 2 x 32 rounds (262,144 tokens,
    # as the 16 GiB row). At batch 4 the MoE backward's workspace (3.64 GB, measured in
    # session 19) beside the arena leaves too little of 8 GiB for the round's objects and
    # the plan does not place; at batch 2, by benchmarks/place_llama3_8b.py on the CPU
    # with the session-20 profiles scaled to the batch (the backward's workspace set to
    # 2.25 GB: its gradient temporaries do not shrink with the tokens), it places and
    # plans 5.67 s a step. Its ratio is to the stock row already in the results (the
    # olmoe16 group's), so run that group first
    {
        compare --family olmoe "${moe[@]}" --rows dataflow --resolver "$moe_resolver" \
            --dataflow-orders layer --dataflow-batches "${OLMOE8_BATCH:-2}" \
            --min-tokens "$olmoe16_tokens" --budgets "${moe_budgets#*,}" --steps 4 --warmup 2 \
            --row-seconds 300 --total-seconds 300
    } 2>&1 | tee "$log"
    ;;
gpt2)
    # issue 13 and 14's rows: the fastest stock row (torch.compile, pure bf16, batch 64;
    # sessions 3-7 never found another faster) beside dataflow at every budget, 524,288
    # tokens a step (GPT-2 124M's usual 0.5M-token step: the host's work between steps,
    # 2-4 ms, is spread over eight times the tokens of a 65,536-token step).
    # GPT2_PART=big runs stock and 16, 8, 4, 2 GiB (about 250 s on the H200 in session
    # 12, the 2 GiB row's setup 60 s of it); GPT2_PART=small the 1 GiB row alone, with a
    # row limit of 540 s and batches 8 and 4: by the roofline (`dataflow predict --preset
    # gpt2_124m --hw h200 --t-round 2048,4096,8192 --tokens-step 524288 --budget 1
    # --seq-len 1024`, session 9) 8 x 64 plans 0.696 s, 4 x 128 0.718 s, 2 x 256 0.782 s;
    # in sessions 9 and 12 its runs spent their 250 s row limit in setup (GPT2_ROW_SECONDS
    # sets that row's limit).
    # Session 20: the roofline ranking put 8 x 64 first at 2 GiB and 4 x 128 at 1 GiB (the
    # rows of sessions 12-17), but planned with the H200 profiles (benchmarks/
    # place_llama3_8b.py --preset gpt2_124m --seq-len 1024 --profiles
    # benchmarks/results/profiles_gpt2.tgz --budget B --batch N --rounds R) larger rounds
    # are faster there, their tasks' fixed costs spread over more tokens: at 2 GiB 8 x 64
    # 1.195 s, 16 x 32 1.155 s, 32 x 16 about 1.13 s (early updates 1.129 s; its head at
    # chunk 1024 estimated from the chunk-4096 profile); at 1 GiB 4 x 128 1.420 s, 8 x 64
    # about 1.35 s, 16 x 32 about 1.24 s (early 1.231 s). So those two rows run the
    # batches given, in that order, with early updates
    part=${GPT2_PART:-both}
    given=(--dataflow-batch-order given --updates early)
    {
        if [ "$part" != small ]; then
            compare --family gpt2 "${gpt2[@]}" --redo --rows stock,dataflow \
                --stock-engines compile --batches 64 --min-tokens "$gpt2_tokens" \
                --budgets "$gpt2_big" --steps 5 --warmup 2 --compile-row-seconds 120 \
                --row-seconds 120 --total-seconds 400
            compare --family gpt2 "${gpt2[@]}" --redo --rows dataflow --min-tokens "$gpt2_tokens" \
                --budgets "$gpt2_two" --dataflow-batches 32,16,8 "${given[@]}" --steps 5 \
                --warmup 2 --row-seconds 150 --total-seconds 150
        fi
        [ "$part" = big ] || compare --family gpt2 "${gpt2[@]}" --redo --rows dataflow \
            --min-tokens "$gpt2_tokens" --budgets "$gpt2_small" --dataflow-batches 16,8,4 \
            "${given[@]}" --steps 4 --warmup 2 --row-seconds "${GPT2_ROW_SECONDS:-540}" \
            --total-seconds 560
    } 2>&1 | tee "$log"
    ;;
qwen3_5 | qwen3_5_moe)
    # issue 46's rows: the 4-layer cuts of Qwen 3.5 9B (qwen3_5_cut, 2.9B parameters, a
    # quarter of them each of the untied token table and head) and of Qwen 3.5 35B-A3B
    # (qwen3_5_moe_cut, 4.4B, 1.3B active), seq 4096, 131,072 tokens a step, stock
    # torch.compile (harness/stock_decoder.py: fla's chunked gated delta rule in the
    # Gated DeltaNet layers) beside dataflow at 16 and 8 GiB, bf16 weights and moments.
    # fla 0.6 refuses its gated backward on Hopper under the image's Triton (its issue
    # #640) unless tilelang is there: carry .tilelang/site.tar.xz (device_setup.sh).
    # Orders and batches by `dataflow predict --preset P --budget B --seq-len 4096
    # --tokens-step 131072 --hw h200 --precision bf16-plain` (session 35, CPU): dense 16 GiB
    # 4 x 8 layer:2 (60,499 tok/s; round order 8 x 4 58,469), 8 GiB 4 x 8 layer:4
    # (51,362); MoE 8 x 4 by layer, 16 GiB 100,317 and 8 GiB 79,739. One call each.
    # Overrides: STOCK_BATCHES (the stock batch search), Q35_TOKENS (dataflow tokens a
    # step), MOE_BATCHES (the MoE rows' batches), ONLY16=1 (the 16 GiB rows alone); the
    # dense 8 GiB row: BATCH8, ORDER8, VOCAB_PIECES (TrainConfig.vocab_pieces); the MoE
    # 8 GiB row apart: EXPERT_SHARDS8 (below). A dataflow row's time limit is 150 s
    # (170 s at 8 GiB); at more than 131,072 tokens a step it is Q35_ROW_SECONDS (default
    # 270): session 39's 16 GiB row of 262,144 tokens (H100) took 95 s to profile, plan
    # and place and 124 s to its first step, so 150 s would have cut it after one step
    rows=150
    [ "${Q35_TOKENS:-$tokens}" -gt 131072 ] && rows=${Q35_ROW_SECONDS:-270}
    # ONLY8=1: stock and the 8 GiB row alone (the 16 GiB row left out), e.g. a later
    # call's 8 GiB row beside stock of its own run
    first=stock,dataflow
    [ "${ONLY8:-0}" = 1 ] && first=stock
    # HEAD_TILES8=1: the 8 GiB rows make the head's weight gradient by vocabulary tiles
    # (--head-vocab-tiles: no float32 (vocabulary, hidden) sum, 4.07 GB for the dense
    # cut's head, which with a chunk's logits leaves no arena at 8 GiB; a third more head
    # compute)
    tiles8=()
    [ "${HEAD_TILES8:-0}" = 1 ] && tiles8=(--head-vocab-tiles)
    # HEAD_ACC8=gradient: the 8 GiB rows' head adds each chunk's weight gradient into its
    # bf16 gradient (--head-accumulate gradient: no float32 sum, no second logits pass)
    [ -n "${HEAD_ACC8:-}" ] && tiles8+=(--head-accumulate "$HEAD_ACC8")
    # ROWS8=N: the 8 GiB rows' block tasks each over the batch in N groups of sequences
    # (--block-row-groups: about 1/N of the linear block's 3.8 GB backward workspace at
    # batch 4; dense only)
    [ -n "${ROWS8:-}" ] && tiles8+=(--block-row-groups "$ROWS8")
    {
        if [ "$group" = qwen3_5 ]; then
            compare --family qwen3_5 "${q35[@]}" --rows "$first" --stock-engines compile \
                --batches "${STOCK_BATCHES:-4,2,1}" --dataflow-batches 4 \
                --dataflow-orders "${ORDER16:-layer:2}" --min-tokens "${Q35_TOKENS:-$tokens}" \
                --budgets "${big_budgets%,*}" --steps 4 --warmup 2 \
                --compile-row-seconds 150 --row-seconds "$rows" --total-seconds $((rows + 180))
            [ "${ONLY16:-0}" = 1 ] || compare --family qwen3_5 "${q35[@]}" --rows dataflow \
                --dataflow-batches "${BATCH8:-4}" --dataflow-orders "${ORDER8:-layer:4}" \
                --vocab-pieces "${VOCAB_PIECES:-1}" "${tiles8[@]}" \
                --min-tokens "${Q35_TOKENS:-$tokens}" --budgets "${big_budgets#*,}" --steps 4 \
                --warmup 2 --row-seconds $((rows + 20)) --total-seconds $((rows + 20))
        else
            budgets=$big_budgets
            [ "${ONLY16:-0}" = 1 ] || [ -n "${EXPERT_SHARDS8:-}" ] && budgets=${big_budgets%,*}
            compare --family qwen3_5_moe "${q35moe[@]}" --rows "$first" \
                --stock-engines compile --resolver "$moe_resolver" \
                --batches "${STOCK_BATCHES:-8,4,2}" --dataflow-batches "${MOE_BATCHES:-8,4}" \
                --dataflow-orders layer --min-tokens "${Q35_TOKENS:-$tokens}" \
                --budgets "$budgets" --steps 4 --warmup 2 --compile-row-seconds 150 \
                --row-seconds $((rows + 20)) --total-seconds $((3 * rows + 50))
            # EXPERT_SHARDS8=N: the 8 GiB row apart, its experts in N shards (--expert-shards)
            # at MOE_BATCH8 (default 2) by ORDER8 (default layer), VOCAB_PIECES vocabulary pieces
            [ -n "${EXPERT_SHARDS8:-}" ] && [ "${ONLY16:-0}" != 1 ] && compare --family qwen3_5_moe \
                "${q35moe[@]}" --rows dataflow --resolver "$moe_resolver" \
                --dataflow-batches "${MOE_BATCH8:-2}" --dataflow-orders "${ORDER8:-layer}" \
                --expert-shards "$EXPERT_SHARDS8" --vocab-pieces "${VOCAB_PIECES:-1}" "${tiles8[@]}" \
                --min-tokens "${Q35_TOKENS:-$tokens}" --budgets "${big_budgets#*,}" --steps 4 \
                --warmup 2 --row-seconds $((rows + 20)) --total-seconds $((rows + 20))
        fi
    } 2>&1 | tee "$log"
    ;;
deepseek)
    # issue 47's rows: the 2-layer cuts (1 dense, 1 MoE layer) of DeepSeek V3
    # (deepseek_v3_cut, 13.9B parameters), DeepSeek V3.2 (deepseek_v32_cut: V3's with a
    # lightning indexer a layer) and GLM 5 (glm5_cut, 12.2B: the MoE layer reuses the dense
    # layer's selection), seq 4096, stock torch.compile (harness/stock_deepseek.py: MLA
    # through SDPA, the sparse layers' selection an SDPA mask, the routed experts as
    # grouped GEMMs; the faster of batch 2 and 1, STOCK_BATCHES) beside dataflow at 16 and
    # 8 GiB, bf16 weights and moments, 131,072 tokens a step (DS_TOKENS).
    # The machine: stock holds 104 GiB of bf16 weights, gradients and AdamW moments (91 GiB
    # for glm5_cut), so an H200, not an H100; and dataflow's pinned pool of that state does
    # not fit one H200's 128 GiB host: `dataflow predict --preset P --seq-len 4096 --budget
    # B --precision bf16-plain --hw h200`, run on the CPU for these rows, finds no step of
    # deepseek_v3_cut or deepseek_v32_cut at 16 or 8 GiB (the least needs 163-193 GiB of
    # host memory). So these rows run on an H200 of a 256 GiB host (the nvidia-h200-x2
    # kind; one GPU used). With the h200 entry's host memory set to 256 GiB (--hw-file) the
    # search picks 524,288 tokens a step (its cap: 16 GiB 16 x 8 rounds, 26,200 tok/s for
    # deepseek_v3_cut, 25,676 deepseek_v32_cut, 30,550 glm5_cut; 8 GiB 8 x 16, 16,824,
    # 16,422 and 19,864), whose 20-32 s steps do not fit a call's rows; at --tokens-step
    # 131072 it picks 16 x 2 rounds at 16 GiB (19,712, 19,545 and 23,105 tok/s, a host
    # of 154, 161 and 143 GiB) and 8 x 4 rounds at 8 GiB (13,948, 13,741 and 16,568; 155,
    # 143 and 138 GiB), layer and round order within 1.5 % of each other: so 16 GiB runs
    # batch 16 (then 8) and 8 GiB batch 8 (then 4), both by layer (DS_BATCHES16,
    # DS_ORDER16, DS_BATCHES8, DS_ORDER8 override them). Tasks compiled as the MoE
    # groups' (MOE_RESOLVER=torch: eager).
    # DS_DTYPES=bf16-int8 runs the dataflow rows with AdamW's moments in 8 bits, which fits
    # one H200's 128 GiB host (`dataflow predict --preset deepseek_v3_cut --budget 16
    # --seq-len 4096 --tokens-step 131072 --dtype bf16 --optimizer-states int8 --hw h200`,
    # session 44: 16 x 2 by layer, 21,665 tok/s, 128 GiB): rows of their own dtype, rated
    # against the bf16 stock row (its moments in bf16), which the table says.
    # Each preset is its own call of under nine minutes (DS_PRESETS, default all three,
    # comma-separated: `DS_PRESETS=deepseek_v3_cut bash benchmarks/model_rows.sh
    # deepseek`): stock and the 16 GiB row (150 s for the compiled row, 160 s for the
    # dataflow one), then the 8 GiB row (170 s); a row its limit cut before it measured a
    # step runs again in the next call (--append keeps the rest). DS_PART=16 runs stock and
    # 16 GiB alone,
    # DS_PART=8 the 8 GiB row alone (its ratio is to the stock row already in the
    # results), each with the call's time to itself, should a first call run out of time
    presets=${DS_PRESETS:-deepseek_v3_cut,deepseek_v32_cut,glm5_cut}
    for preset in ${presets//,/ }; do
        case $preset in deepseek_v3_cut | deepseek_v32_cut | glm5_cut | moonlight_16b_a3b) ;;
        *) echo "model_rows.sh deepseek: unknown preset '$preset' (deepseek_v3_cut, deepseek_v32_cut, glm5_cut or moonlight_16b_a3b)" >&2
            exit 2 ;;
        esac
    done
    part=${DS_PART:-both}
    if [ "$part" = 16 ]; then row16=(--compile-row-seconds 180 --row-seconds 300 --total-seconds 500)
    else row16=(--compile-row-seconds 150 --row-seconds 160 --total-seconds 310); fi
    if [ "$part" = 8 ]; then row8=(--row-seconds 500 --total-seconds 500)
    else row8=(--row-seconds 170 --total-seconds 170); fi
    {
        for preset in ${presets//,/ }; do
            if [ "$preset" = moonlight_16b_a3b ]; then
                # the whole 16B model (issue 47: "that 16B preset whole at 16 GiB"), dataflow
                # alone (stock's bf16 weights, gradients and moments, 128 GB, leave the H200
                # no room to train): with bf16 moments no plan fits the 128 GiB host (`dataflow
                # predict --preset moonlight_16b_a3b --budget 16 --seq-len 4096 --tokens-step
                # 131072 --dtype bf16 --optimizer-states bf16 --hw h200`, session 44: least
                # 173 GiB), with 8-bit moments 4 x 8 by round order, experts in 2 shards,
                # 10,258 tok/s predicted; so its row is bf16-int8 unless DS_DTYPES says
                [ "${SMOKE:-0}" = 1 ] && moon=deepseek_v3_tiny || moon=$preset
                compare --family deepseek_v3 --preset "$moon" --seq-len "$ds_seq" \
                    --resolver "$moe_resolver" --min-tokens "${DS_TOKENS:-$tokens}" --steps 3 \
                    --warmup 1 --rows dataflow --dataflow-dtypes "${DS_DTYPES:-bf16-int8}" \
                    --dataflow-batches 4,2 --dataflow-batch-order given --dataflow-orders round \
                    --expert-shards 2 --budgets "${moe_budgets%,*}" --row-seconds 500 \
                    --total-seconds 520
                continue
            fi
            family=${preset%_cut}  # deepseek_v3, deepseek_v32, glm5
            [ "${SMOKE:-0}" = 1 ] && preset=${family}_tiny
            ds=(--family "$family" --preset "$preset" --seq-len "$ds_seq" --resolver "$moe_resolver"
                --min-tokens "${DS_TOKENS:-$tokens}" --steps 3 --warmup 1
                --dataflow-dtypes "${DS_DTYPES:-bf16}")
            [ "$part" = 8 ] || compare "${ds[@]}" --rows stock,dataflow --stock-engines compile \
                --batches "${STOCK_BATCHES:-2,1}" --dataflow-batches "${DS_BATCHES16:-$ds_batches16}" \
                --dataflow-orders "${DS_ORDER16:-layer}" --budgets "${moe_budgets%,*}" "${row16[@]}"
            [ "$part" = 16 ] || compare "${ds[@]}" --rows dataflow \
                --dataflow-batches "${DS_BATCHES8:-$ds_batches8}" --dataflow-orders "${DS_ORDER8:-layer}" \
                --budgets "${moe_budgets#*,}" "${row8[@]}"
        done
    } 2>&1 | tee "$log"
    ;;
large)
    # issue 50's rows on the H200 (stock 8B needs 87 GiB, stock 14B with checkpointing
    # most of the card), one call of under nine minutes each, by LARGE_PART:
    # - 14b: qwen3_14b (Qwen3-14B's published shape, 14.8B) at 16 GiB, seq 4096, 131,072
    #   tokens a step, bf16 weights and gradients with AdamW's moments in 8 bits
    #   (`--dataflow-dtypes bf16-int8`: with bf16 moments the plan's slow pool outgrows the
    #   128 GiB host), beside stock torch.compile with full activation checkpointing, the
    #   issue's baseline (without checkpointing stock 14B does not fit the H200, so the
    #   plain row is not tried: --only-checkpoint-row). `dataflow predict --preset
    #   qwen3_14b --budget 16 --seq-len 4096 --tokens-step 131072 --optimizer-states int8
    #   --hw h200` (session 44, CPU): batch 4 x 8 by round order, 6,568 tok/s, 128 GiB of
    #   host; runner-up 2 x 16 by layer:2, 6,563; batch 4 is tried first, then 2.
    # - long-stock: stock compile + full checkpointing of llama3_8b at batch 1 for each of
    #   LONG_SEQS (default 131072,65536,32768), longest first, stopping at the first that
    #   trains (a row that ran out of memory is tried again by a later call: give that call
    #   the lengths left in LONG_SEQS): the longest sequence stock trains on the H200, and its MFU (each row's
    #   details keep `mfu_causal`, attention counted causally). LONG_CCE=1 gives stock
    #   cut_cross_entropy's fused linear cross-entropy (its wheel in .whl/optional/, not
    #   yet run on the device; without it the logits of 131,072 tokens alone are 34 GB in
    #   bf16 and twice that in the float32 loss).
    # - long: dataflow's llama3_8b at seq LONG_SEQ (default 131072) inside 16 GiB, 131,072
    #   tokens a step (LONG_TOKENS), one sequence a round, by round order (`dataflow
    #   predict --preset llama3_8b --budget 16 --seq-len N --tokens-step 131072 --precision
    #   bf16-plain --hw h200`, session 44: at 131,072 one round, 3,648 tok/s, 122 GiB of
    #   host; at 32,768 batch 1 x 4 rounds, 8,057 tok/s, 127 GiB).
    # Each row is rated against the stock rows of its own sequence length; the issue's
    # long-context target compares MFU across lengths (docs/throughput.md, issue 50).
    case ${LARGE_PART:-14b} in 14b | long-stock | long) ;;
    *) echo "model_rows.sh large: LARGE_PART is 14b, long-stock or long, not '$LARGE_PART'" >&2
        exit 2 ;;
    esac
    large=()  # compare's options less --no-checkpoint-row (these rows set their own)
    for option in "${common[@]}"; do [ "$option" = --no-checkpoint-row ] || large+=("$option"); done
    largecmp() { python -m benchmarks.compare "${large[@]}" --out "$out_json" --doc "$page" "$@"; }
    if [ "${SMOKE:-0}" = 1 ]; then
        p14=qwen3_tiny p8=llama3_tiny seq14=32 seqs=${LONG_SEQS:-64,32} lseq=${LONG_SEQ:-64}
        ltokens=${LONG_TOKENS:-128}
    else
        p14=${LARGE_PRESET:-qwen3_14b} p8=llama3_8b seq14=4096
        seqs=${LONG_SEQS:-131072,65536,32768} lseq=${LONG_SEQ:-131072}
        ltokens=${LONG_TOKENS:-131072}
    fi
    {
        case ${LARGE_PART:-14b} in
        14b)
            largecmp --family qwen3 --preset "$p14" --seq-len "$seq14" --rows stock,dataflow \
                --stock-engines compile --only-checkpoint-row --batches "${STOCK_BATCHES:-4,2,1}" \
                --dataflow-dtypes bf16-int8 --dataflow-batches 4,2 --dataflow-batch-order given \
                --dataflow-orders "${ORDER16:-round}" --min-tokens "$big_tokens" \
                --budgets "${big_budgets%,*}" --steps 3 --warmup 1 \
                --compile-row-seconds 200 --row-seconds 330 --total-seconds 540
            ;;
        long-stock)
            ce=()
            if [ "${LONG_CCE:-0}" = 1 ]; then
                python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site \
                    .whl/optional/cut_cross_entropy-*.whl
                ce=(--stock-ce cce)
            fi
            for seq in ${seqs//,/ }; do
                largecmp --family llama3 --preset "$p8" --seq-len "$seq" --rows stock \
                    --stock-engines compile --only-checkpoint-row --batches 1 "${ce[@]}" \
                    --steps 2 --warmup 1 --compile-row-seconds 250 --total-seconds 260
                # the longest that trains is the one the issue asks for: stop there
                python -c 'import json, sys; f, m, n = sys.argv[1:]; sys.exit(not any(
                    r["model"] == m and r["seq_len"] == int(n) and r["tok_s"]
                    and r["engine"].endswith("checkpointing") for r in json.load(open(f))["rows"]))' \
                    "$out_json" "$p8" "$seq" && break
            done
            ;;
        long)
            largecmp --family llama3 --preset "$p8" --seq-len "$lseq" --rows dataflow \
                --dataflow-batches 1 --dataflow-batch-order given --min-tokens "$ltokens" \
                --dataflow-orders "${LONG_ORDER:-round}" --budgets "${big_budgets%,*}" \
                --steps 3 --warmup 1 --row-seconds 540 --total-seconds 540
            ;;
        esac
    } 2>&1 | tee "$log"
    ;;
*)
    echo "model_rows.sh: unknown group '$group' (llama3_8b, llama3_8b_lora, l3_1b, olmoe, olmoe16, olmoe8, small, gpt2, qwen3_5, qwen3_5_moe, deepseek or large)" >&2
    exit 2
    ;;
esac
if [ -n "${OUT:-}" ]; then
    cp "$out_json" "$page" "$OUT/"
    [ -d "$cache" ] && tar czf "$OUT/profiles_$group.tgz" -C "$cache" .
fi

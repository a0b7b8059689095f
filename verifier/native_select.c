/* The k largest of each row of logits, and so its argmax: what a round reads from the output layer.
 *
 * torch's top-k and argmax over a [n, vocabulary] float32 tensor cost a verification 0.3-2 ms (they
 * sort, and an argmax of one 49k-entry row still wakes a thread team). A row's k best need one pass:
 * a vector compare against the k-th best so far skips almost every element, and the few that pass
 * are inserted in order. The order is fixed, so a row's answer depends on that row alone: larger
 * values first, equal values by position (the first occurrence ahead, so the first id is exactly
 * torch.argmax's), and NaN above every number (as torch.argmax, which propagates it).
 */
#include <stdint.h>

#include "native_pool.h"
#include "native_vec.h"

/* Whether a ranks above b (b came first on ties). */
static inline int above(float a, float b) { return a > b || (a != a && b == b); }

/* Inserts value v at id into the descending list (vals, ids) of *have entries (at most k). */
static inline void insert(float *vals, int64_t *ids, long *have, long k, float v, int64_t id)
{
    long i;
    if (*have < k)
        i = (*have)++;
    else if (above(v, vals[k - 1]))
        i = k - 1;
    else
        return;
    while (i > 0 && above(v, vals[i - 1])) {
        vals[i] = vals[i - 1];
        ids[i] = ids[i - 1];
        i--;
    }
    vals[i] = v;
    ids[i] = id;
}

static void row_top(const float *x, long V, long k, int64_t *ids)
{
    float vals[k];
    long have = 0, j = 0;
    for (; j < V && have < k; j++) insert(vals, ids, &have, k, x[j], j);
    for (; j + VL <= V; j += VL) {
        const vf v = load_f32(x + j);
        const vi pass = (v > vals[k - 1]) | (v != v); /* NaN passes: the scalar test ranks it */
        int any = 0;
        for (int l = 0; l < VL; l++) any |= pass[l];
        if (!any) continue;
        for (long i = j; i < j + VL; i++) insert(vals, ids, &have, k, x[i], i);
    }
    for (; j < V; j++) insert(vals, ids, &have, k, x[j], j);
}

struct top_call {
    const float *x;
    long V, k;
    int64_t *ids;
};

static void top_items(void *ctx, long lo, long hi, int tid)
{
    const struct top_call *c = ctx;
    (void)tid;
    for (long r = lo; r < hi; r++) row_top(c->x + r * c->V, c->V, c->k, c->ids + r * c->k);
}

/* ids [n, k]: each row's k largest entries of x [n, V] (row-major float32), largest first, ties by
 * position. 0, or -1 for k outside [1, V]. Rows are independent: any thread count, the same ids. */
int racer_top_rows(const float *x, long n, long V, long k, int64_t *ids, int threads)
{
    if (k < 1 || k > V || k > 4096) return -1;
    struct top_call c = {x, V, k, ids};
    racer_pfor(n, 1, n * V >= 262144 ? threads : 1, top_items, &c);
    return 0;
}

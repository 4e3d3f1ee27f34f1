/*
 * Inner loop of the micro-batch DP: F(t_cap), the least total time of cutting the
 * ordered samples into consecutive micro-batches none of which takes longer than t_cap.
 *
 * Compiled for speed only; dynapipe/batching/dp_partition.py holds a numpy version of
 * the same recurrence that gives bit-identical results (same additions in the same
 * order, same tie-breaking: the smallest micro-batch among equal totals).
 *
 * Data layout (all C-contiguous, checked by the Python wrapper):
 *   time_ms[offsets[r] + k - 1]  time of a k-sample micro-batch in row r (ms)
 *   row_len[r]                   entries in row r
 *   row_of_end[j]                row priced for micro-batches ending at position j (1..n)
 *   total[0..n], choice[0..n]    outputs: F of each prefix, size of its last micro-batch
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Whether a buffer format's byte-order prefix (none, '@', '=', '<', '>' or '!') is this machine's. */
static int native_order(const char *fmt) {
    const uint16_t probe = 1;
    const int little = *(const uint8_t *)&probe == 1;
    switch (fmt[0]) {
        case '<': return little;
        case '>': case '!': return !little;
        default: return 1;
    }
}

/* A C-contiguous buffer of native 8-byte items: kind 'f' (float64) or 'i' (int64). */
static int get(PyObject *obj, Py_buffer *view, int writable, char kind, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    const char *fmt = view->format ? view->format : "B";
    char code = fmt[strlen(fmt) - 1];
    int ok = view->itemsize == 8 && native_order(fmt) && (kind == 'f' ? code == 'd' : (code == 'q' || code == 'l'));
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s: expected a contiguous %s array in native byte order", name,
                     kind == 'f' ? "float64" : "int64");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *solve_capped(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_time, *o_off, *o_len, *o_row, *o_total, *o_choice;
    double cap;
    int monotone;
    if (!PyArg_ParseTuple(args, "OOOOdpOO", &o_time, &o_off, &o_len, &o_row, &cap, &monotone,
                          &o_total, &o_choice))
        return NULL;
    Py_buffer b_time, b_off, b_len, b_row, b_total, b_choice;
    if (get(o_time, &b_time, 0, 'f', "time_ms") < 0) return NULL;
    if (get(o_off, &b_off, 0, 'i', "offsets") < 0) goto e1;
    if (get(o_len, &b_len, 0, 'i', "row_len") < 0) goto e2;
    if (get(o_row, &b_row, 0, 'i', "row_of_end") < 0) goto e3;
    if (get(o_total, &b_total, 1, 'f', "total") < 0) goto e4;
    if (get(o_choice, &b_choice, 1, 'i', "choice") < 0) goto e5;

    const double *time_ms = (const double *)b_time.buf;
    const int64_t *off = (const int64_t *)b_off.buf, *len = (const int64_t *)b_len.buf;
    const int64_t *row = (const int64_t *)b_row.buf;
    double *total = (double *)b_total.buf;
    int64_t *choice = (int64_t *)b_choice.buf;
    Py_ssize_t n = b_row.len / 8 - 1, rows = b_off.len / 8, entries = b_time.len / 8;
    if (n < 1 || b_total.len / 8 != n + 1 || b_choice.len / 8 != n + 1 || b_len.len / 8 != rows) {
        PyErr_SetString(PyExc_ValueError, "solve_capped: inconsistent array sizes");
        goto e6;
    }
    for (Py_ssize_t j = 1; j <= n; j++) {
        int64_t r = row[j];
        if (r < 0 || r >= rows || off[r] < 0 || off[r] + len[r] > entries) {
            PyErr_SetString(PyExc_ValueError, "solve_capped: row index or offset out of range");
            goto e6;
        }
    }
    double max_t = 0.0;
    Py_BEGIN_ALLOW_THREADS
    total[0] = 0.0;
    choice[0] = 0;
    for (Py_ssize_t j = 1; j <= n; j++) {
        const double *t_row = time_ms + off[row[j]];
        int64_t kmax = len[row[j]] < j ? len[row[j]] : j;
        double best = INFINITY;
        int64_t arg = 0;
        for (int64_t k = 1; k <= kmax; k++) {
            double t = t_row[k - 1];
            if (!(t <= cap)) {
                if (monotone) break;
                continue;
            }
            double c = total[j - k] + t;
            if (c < best) {
                best = c;
                arg = k;
            }
        }
        total[j] = best;
        choice[j] = arg;
    }
    if (isfinite(total[n])) {
        for (Py_ssize_t j = n; j > 0; j -= choice[j]) {
            double t = time_ms[off[row[j]] + choice[j] - 1];
            if (t > max_t) max_t = t;
        }
    }
    Py_END_ALLOW_THREADS
    double f_n = total[n];
    PyBuffer_Release(&b_choice);
    PyBuffer_Release(&b_total);
    PyBuffer_Release(&b_row);
    PyBuffer_Release(&b_len);
    PyBuffer_Release(&b_off);
    PyBuffer_Release(&b_time);
    return Py_BuildValue("dd", f_n, isfinite(f_n) ? max_t : INFINITY);

e6: PyBuffer_Release(&b_choice);
e5: PyBuffer_Release(&b_total);
e4: PyBuffer_Release(&b_row);
e3: PyBuffer_Release(&b_len);
e2: PyBuffer_Release(&b_off);
e1: PyBuffer_Release(&b_time);
    return NULL;
}

static PyMethodDef methods[] = {
    {"solve_capped", solve_capped, METH_VARARGS,
     "solve_capped(time_ms, offsets, row_len, row_of_end, cap_ms, monotone, total, choice) -> (F_n, max_t)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dp_kernel", "Compiled inner loop of the micro-batch DP.",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__dp_kernel(void) { return PyModule_Create(&module); }

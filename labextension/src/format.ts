/**
 * Pure formatting of what the kernel's `jupyter_shard` comm replies (no JupyterLab imports, so the
 * Jest tests run it directly). The shapes mirror `jupyter_shard/notebook/panel.py`.
 */

export interface IRankRow {
  /** A rank, or from 9 ranks the ranks of a row per state or trouble ("0-4,6-1023"). */
  rank: number | string;
  /** How many ranks the row stands for (absent: one). */
  count?: number;
  state: string;
  step: number | null;
  memory: { rss: number | null; cuda: number | null };
  heartbeat_age: number | null;
  cell: string;
  problem: string;
}

export interface IStatusReply {
  reply: 'status';
  pool: string | null;
  state: string;
  ranks: IRankRow[];
  message?: string;
}

export interface IStacksReply {
  reply: 'stacks';
  text: string;
}

export interface IErrorReply {
  reply: 'error';
  error: string;
  request?: string;
}

export type Reply = IStatusReply | IStacksReply | IErrorReply;

export type Request = 'status' | 'interrupt' | 'restart' | 'shutdown' | 'stacks';

/** A reply from the kernel, or null when the data is not one (another tool's message). */
export function parseReply(data: unknown): Reply | null {
  if (typeof data !== 'object' || data === null) {
    return null;
  }
  const reply = (data as { reply?: unknown }).reply;
  return reply === 'status' || reply === 'stacks' || reply === 'error' ? (data as Reply) : null;
}

export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined) {
    return '–';
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value >= 100 || unit === 0 ? value.toFixed(0) : value.toFixed(1)} ${units[unit]}`;
}

export function formatAge(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined) {
    return '–';
  }
  return seconds < 10 ? `${seconds.toFixed(1)} s` : `${seconds.toFixed(0)} s`;
}

export function formatStep(step: number | null | undefined): string {
  if (step === null || step === undefined) {
    return '–';
  }
  return Number.isInteger(step) ? String(step) : step.toFixed(1);
}

/** The status-bar text: "2 CPU ranks · ddp · idle", with "kernel busy" when the kernel cannot answer. */
export function statusBarText(status: IStatusReply | null, kernelBusy: boolean): string {
  if (status === null || status.pool === null) {
    return '';
  }
  return `${status.pool} · ${status.state}${kernelBusy ? ' (kernel busy)' : ''}`;
}

const hasCuda = (row: IRankRow) => row.memory.cuda !== null && row.memory.cuda !== undefined;

/**
 * One table row of the side panel for a rank, in column order: the columns that matter first, few
 * enough to fit the panel's width (what a problem is: its first word; on GPU, CUDA memory); the
 * rest is the row's hover text (`rankTitle`).
 */
export function rankCells(row: IRankRow): string[] {
  const word = row.problem ? row.problem.split(':', 1)[0] : row.state;
  const state = row.count !== undefined && row.count > 1 ? `${word} (${row.count})` : word;
  const memory = hasCuda(row) ? formatBytes(row.memory.cuda) : formatBytes(row.memory.rss);
  return [String(row.rank), state, formatStep(row.step), memory];
}

/**
 * The rest of a rank's row, shown on hover: the problem in full, heartbeat, host memory, cell. A row
 * of several ranks gives the lowest step, the largest memory and the oldest heartbeat among them.
 */
export function rankTitle(row: IRankRow): string {
  const many = row.count !== undefined && row.count > 1;
  const parts = [many ? `ranks ${row.rank} (${row.count}): ${row.problem || row.state}` : `rank ${row.rank}: ${row.problem || row.state}`];
  const most = many ? 'at most ' : '';
  parts.push(`heartbeat ${most}${formatAge(row.heartbeat_age)} ago`);
  if (many && row.step !== null) {
    parts.push(`lowest step ${formatStep(row.step)}`);
  }
  parts.push(hasCuda(row) ? `host ${most}${formatBytes(row.memory.rss)} · cuda ${most}${formatBytes(row.memory.cuda)}` : `host ${most}${formatBytes(row.memory.rss)}`);
  if (row.cell) {
    parts.push(`cell: ${row.cell}`);
  }
  return parts.join('\n');
}

export const RANK_COLUMNS = ['rank', 'state', 'step', 'memory'];

/** States of a rank that the panel draws red: a broken rank lost its CUDA context and needs a restart. */
const ERROR_STATES = ['dead', 'failed', 'broken'];

/** Whether a rank row needs attention (drawn red or yellow): a rank at a prompt waits for the person. */
export function rankLevel(row: IRankRow): 'ok' | 'warn' | 'error' {
  if (ERROR_STATES.includes(row.state) || /^(dead|broken):/.test(row.problem)) {
    return 'error';
  }
  return row.problem || row.state === 'at a prompt' ? 'warn' : 'ok';
}

/** The picker's widget message asking for a new cell, or null for any other message. */
export function insertCellCode(data: unknown): string | null {
  if (typeof data !== 'object' || data === null) {
    return null;
  }
  const { method, content } = data as { method?: unknown; content?: unknown };
  if (method !== 'custom' || typeof content !== 'object' || content === null) {
    return null;
  }
  const { event, code } = content as { event?: unknown; code?: unknown };
  return event === 'insert-cell' && typeof code === 'string' ? code : null;
}

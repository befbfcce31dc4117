/**
 * One notebook kernel's `jupyter_shard` comm: open it, send requests, keep the last status.
 *
 * The kernel answers only between cells; while it runs a foreground cell a request waits, and the
 * client keeps the last status and reports the kernel busy. A kernel without `%load_ext
 * jupyter_shard` closes the comm at once; the next request tries again.
 */
import { ISessionContext } from '@jupyterlab/apputils';
import { Kernel } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

import { IStatusReply, parseReply, Request } from './format';

export const COMM_TARGET = 'jupyter_shard';

/** A request unanswered this long while the kernel is idle was lost (a restarted kernel): resend. */
const STALE_MS = 5000;

export type Connection = 'no kernel' | 'not loaded' | 'connected';

export class ShardClient {
  constructor(readonly session: ISessionContext) {
    session.kernelChanged.connect(this._reset, this);
  }

  status: IStatusReply | null = null;
  stacks = '';
  message = '';
  error = '';
  connection: Connection = 'no kernel';
  /** A request is waiting for its reply (the kernel is running a cell). */
  pending = false;

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  get kernelBusy(): boolean {
    return this.pending && this.session.session?.kernel?.status === 'busy';
  }

  /** Send a request; a status request already waiting is not sent twice. */
  request(request: Request): void {
    const waited = Date.now() - this._sentAt;
    const idle = this.session.session?.kernel?.status === 'idle';
    if (request === 'status' && this.pending && !(idle && waited > STALE_MS)) {
      this._changed.emit();
      return;
    }
    const kernel = this.session.session?.kernel;
    if (!kernel) {
      this.connection = 'no kernel';
      this._changed.emit();
      return;
    }
    if (request === 'interrupt' && kernel.status === 'busy') {
      // A foreground cell holds the kernel, which answers comms only between cells; a kernel
      // interrupt reaches the cell, and %%distributed passes it on to the ranks.
      void kernel.interrupt();
      this.message = 'interrupted the running cell';
      this._changed.emit();
      return;
    }
    const comm = this._comm ?? this._open(kernel, request);
    if (comm && comm !== this._justOpened) {
      comm.send({ request });
    }
    this._justOpened = null;
    this._sentAt = Date.now();
    this.pending = true;
    this._changed.emit();
  }

  dispose(): void {
    this.session.kernelChanged.disconnect(this._reset, this);
    this._closeComm();
    Signal.clearData(this);
  }

  private _open(kernel: Kernel.IKernelConnection, request: Request): Kernel.IComm | null {
    let comm: Kernel.IComm;
    try {
      comm = kernel.createComm(COMM_TARGET);
    } catch {
      return null;
    }
    comm.onMsg = msg => this._onReply(msg.content.data);
    comm.onClose = () => {
      if (this._comm === comm) {
        this._comm = null;
        this.pending = false;
        if (this.connection !== 'connected' || this.status === null) {
          this.connection = 'not loaded';
        }
        this._changed.emit();
      }
    };
    comm.open({ request });
    this._comm = comm;
    this._justOpened = comm;
    return comm;
  }

  private _onReply(data: unknown): void {
    const reply = parseReply(data);
    if (reply === null) {
      return;
    }
    this.pending = false;
    this.connection = 'connected';
    if (reply.reply === 'status') {
      this.status = reply;
      this.message = reply.message ?? '';
      this.error = '';
    } else if (reply.reply === 'stacks') {
      this.stacks = reply.text;
      this.error = '';
    } else {
      this.error = reply.error;
    }
    this._changed.emit();
  }

  private _reset(): void {
    this._closeComm();
    this.status = null;
    this.connection = 'no kernel';
    this.pending = false;
    this._changed.emit();
  }

  private _closeComm(): void {
    const comm = this._comm;
    this._comm = null;
    if (comm && !comm.isDisposed) {
      try {
        comm.close();
      } catch {
        // the kernel is gone; nothing to close
      }
    }
  }

  private _sentAt = 0;
  private _comm: Kernel.IComm | null = null;
  private _justOpened: Kernel.IComm | null = null;
  private _changed = new Signal<this, void>(this);
}
